"""What guides the policy beyond its reward: the teacher (on-policy distillation, hindsight
contexts), the PRM judge (bridge-thought hints), and the "old" policy of the PPO ratio.

Each is used by the logprobs stage of the RL step (``train/rl/stages.py compute_logprobs``)
and built by ``train/build.py``; none of them trains.
"""
