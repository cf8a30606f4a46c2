"""Worker process of `MathVerifier`: reads {"prediction","reference","tolerance"} lines,
answers {"equal": bool} or {"error": str}. Started as `python -m`; never imported by the trainer."""

import json
import resource
import sys


def main():
    memory_bytes = int(sys.argv[1]) * 2**20 if len(sys.argv) > 1 else 0
    from agentrl_jax.rewards.math_equiv import math_equal

    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    math_equal("1", "1")  # warm sympy's lazy imports before declaring readiness
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
