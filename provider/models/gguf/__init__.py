"""GGUF files (llama.cpp's and Ollama's format) imported as normal MLX model folders.

* `reader`: the header (metadata, tensor table) checked against the file before any tensor is read
* `codes`: one tensor's ggml blocks as MLX arrays (codes kept, requantized, or floats)
* `architectures`: llama / qwen2 / qwen3 hyperparameters as mlx-lm's config.json, tensor names
* `tokenizer`: the vocabulary in the metadata as tokenizer.json and tokenizer_config.json
* `importer`: `plan_import` (everything decided from the header) and `write_folder` (all or nothing)

`provider/importing.py` is the `import` command and the import of a model a request names.

Why not a converter from PyPI: `gguf2mlx` 2.2.0 (Apache-2.0) converts llama / qwen / mistral GGUFs and
has a mode that keeps source codes. On SmolLM2-135M-Instruct's Q4_1 file, on this project's 2-core
machine, its `--preserve-source-quant` kept only the Q8_0 embedding as codes and wrote the 210 Q4_1
tensors (and the float32 norms) as float16: 0.24 GB instead of 0.10 GB, in 27 s (this import: 0.10 GB,
every code kept, 6-8 s). It reads the file with `gguf.GGUFReader` (5 s of that for the header alone),
its MLX dependencies install on Apple Silicon only, and it is 4,300 lines of one module for a job this
package does in five small ones. MLX's own reader (`mx.load("x.gguf")`) keeps Q4_0 / Q4_1 / Q8_0 as
affine codes too, and the tests check that ours are its words, scales and biases bit for bit; it is not
used for the import because it decodes every other type to float16 silently (a Q4_K_M file would
quadruple), loads the whole file into memory at once, and maps the file unchecked (a truncated file
faults instead of raising).
"""

from provider.models.gguf.importer import (
    MARKER,
    ImportPlan,
    is_current,
    plan_import,
    read_marker,
    source_fingerprint,
    write_folder,
    write_tokenizer_folder,
)
from provider.models.gguf.reader import GgufError, GgufHeader, opened, read_header

__all__ = ["MARKER", "GgufError", "GgufHeader", "ImportPlan", "is_current", "opened", "plan_import", "read_header",
           "read_marker", "source_fingerprint", "write_folder", "write_tokenizer_folder"]
