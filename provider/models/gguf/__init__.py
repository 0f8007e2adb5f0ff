"""GGUF files (llama.cpp's and Ollama's format) imported as normal MLX model folders.

* `reader`: the header (metadata, tensor table) checked against the file before any tensor is read
* `codes`: one tensor's ggml blocks as MLX arrays (codes kept, requantized, or floats)
* `architectures`: llama / qwen2 / qwen3 hyperparameters as mlx-lm's config.json, tensor names
* `tokenizer`: the vocabulary in the metadata as tokenizer.json and tokenizer_config.json
* `importer`: `plan_import` (everything decided from the header) and `write_folder` (all or nothing)

`provider/importing.py` is the `import` command and the import of a model a request names.
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
