"""The RL step as stage functions and the one loop that runs them (``loop.py``).

``roles.py`` holds what the loop uses (the models by role, the jitted step functions and
everything else built once by ``train/build.py``); ``collect.py`` the rollouts, judge and
evaluation; ``stages.py`` build batch / logprobs / push weights / log / save, each taking
what it uses as arguments; ``loop.py`` the minibatch update; ``admission.py`` when a
step's rollouts may start (synchronous and asynchronous RL); ``stream.py`` the stream of
groups that replaces it with ``async_rl.mode='stream'``.
"""

from agentrl_jax.train.rl.loop import LoopResult, run_rl, train_step
from agentrl_jax.train.rl.roles import RL, Roles, StepFunctions

__all__ = ["RL", "LoopResult", "Roles", "StepFunctions", "run_rl", "train_step"]
