"""Worker process of `MathVerifier`: reads {"prediction","reference","tolerance"} lines,
answers {"equal": bool} or {"error": str}. Started as `python -m`; never imported by the trainer.

math-verify's own signal-based timeouts are off (`math_equiv` passes None): the parent
kills this process when a comparison overruns, which also covers hangs inside parsing.
"""

import json
import logging
import resource
import sys


def main():
    memory_bytes = int(sys.argv[1]) * 2**20 if len(sys.argv) > 1 else 0
    from agentrl_jax.rewards.math_equiv import math_equal

    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning is intended
    math_equal("\\frac{1}{2}", "\\sqrt{1/4}")  # load math-verify's grammar before declaring readiness
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"equal": bool(math_equal(request["prediction"], request["reference"], request["tolerance"]))}
        except Exception as e:  # a bad answer is a failed verification, not a dead worker
            reply = {"equal": False, "error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
