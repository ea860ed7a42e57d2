"""Writes the vendored schemas here from KServe's CRDs (see README.md in this folder):

    git clone --bare --depth 1 --branch v0.20.0 https://github.com/kserve/kserve /tmp/kserve.git
    python deploy/kserve/schemas/extract.py /tmp/kserve.git v0.20.0

Each file is the ``openAPIV3Schema`` of the CRD's served version, as KServe generates it, with
``status`` left out (the controller writes it) and, for the InferenceService, only the predictor:
mmad runs as a predictor with ``model`` (a ServingRuntime's container), so the transformer,
explainer, the per-framework predictor fields (sklearn, triton, ...) and ``workerSpec`` (multi-node
LLM serving) are left out too. A manifest that uses a left-out field fails validation here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CRDS = {
    "servingruntime.v1alpha1.json": "config/crd/full/serving.kserve.io_servingruntimes.yaml",
    "inferenceservice.v1beta1.json": "config/crd/full/serving.kserve.io_inferenceservices.yaml",
}
FRAMEWORKS = ("huggingface", "lightgbm", "onnx", "paddle", "pmml", "pytorch", "sklearn", "tensorflow", "triton",
              "xgboost", "workerSpec")


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], capture_output=True, text=True, check=True).stdout


def schema(git_dir: str, ref: str, path: str) -> dict:
    crd = yaml.safe_load(git(git_dir, "show", f"{ref}:{path}"))
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    doc = version["schema"]["openAPIV3Schema"]
    doc["properties"].pop("status", None)
    if crd["spec"]["names"]["kind"] == "InferenceService":
        spec = doc["properties"]["spec"]
        spec["properties"] = {"predictor": spec["properties"]["predictor"]}
        for name in FRAMEWORKS:
            spec["properties"]["predictor"]["properties"].pop(name)
    commit = git(git_dir, "rev-parse", f"{ref}^{{commit}}").strip()
    return {"$comment": f"kserve/kserve {ref} ({commit}) {path}, {crd['spec']['group']}/{version['name']} "
                        f"{crd['spec']['names']['kind']}; Apache-2.0; extracted by extract.py", **doc}


def main(argv: list[str]) -> int:
    git_dir, ref = argv
    for name, path in CRDS.items():
        (HERE / name).write_text(json.dumps(schema(git_dir, ref, path), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
