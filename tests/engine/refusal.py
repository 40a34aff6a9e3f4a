"""Start an in-process engine with some plugin options in a child process; print how start-up ended.

``python refusal.py MODEL_DIR ADDITIONAL_CONFIG_JSON`` prints ``ENGINE_START <json>``:
``{"started": true}`` or ``{"error": <exception type>, "message": <its text>}``. A wheel
that refuses an option stops start-up half way (its worker already built); in a child,
nothing of that engine stays in the test process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model_dir: str, additional_config: str) -> None:
    from engine_run import ENGINE_GEOMETRY, build_llm

    try:
        llm = build_llm(Path(model_dir), ENGINE_GEOMETRY, additional_config=json.loads(additional_config))
    except Exception as error:  # noqa: BLE001 - what start-up raised is the result
        result = {"error": type(error).__name__, "message": str(error)}
    else:
        llm.llm_engine.engine_core.shutdown()
        result = {"started": True}
    print("ENGINE_START " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
