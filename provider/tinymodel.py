"""Tiny offline models for tests, benchmarks and the demo.

`build_tiny_model` writes a complete model folder in the normal MLX / Hugging Face layout
(`config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`) that `mlx_lm.load(path)` loads unchanged. Nothing is downloaded:

* the tokenizer is a byte-level BPE trained with `tokenizers` on a seeded synthetic corpus
  (pseudo-words plus some multi-byte UTF-8 text), with ChatML special tokens
  `<|endoftext|>` (0, bos/pad), `<|im_start|>` (1) and `<|im_end|>` (2, eos);
* the weights are a seeded random init of `mlx_lm.models.llama.Model`.

Presets (the small ones are float32 because float32 is the fastest dtype on an x86 CPU;
`1b` and `8b` are the real shapes measured on a GPU, in bfloat16):

| preset | hidden/layers/ffn/heads/kv/vocab | context | weights          |
| ------ | -------------------------------- | ------- | ---------------- |
| tiny   | 256/2/256/4/2/2048               | 2048    | ~5.2 MB fp32     |
| small  | 512/4/1024/8/4/6144              | 4096    | ~50 MB fp32      |
| medium | 1024/8/2816/16/4/8192            | 4096    | ~394 MB fp32     |
| 1b     | 2048/16/8192/32/8/32000          | 8192    | ~2.1 GB bf16     |
| 8b     | 4096/32/14336/32/8/32000         | 8192    | ~14.2 GB bf16    |

Weights are drawn with `mx.random` on the default device (the GPU where there is one) and written
one safetensors shard (at most 5 GiB) at a time, each tensor computed just before its shard is
written: building never holds the model twice, and the 8B builds in the time its bytes take to
reach the disk.

`no_eos=True` (`--no-eos`) zeroes the embedding rows of the EOS ids the config and tokenizer
declare (`<|endoftext|>` 0 and `<|im_end|>` 2). The embeddings are tied, so those tokens' logits
are exactly 0 while the largest of the others is positive: greedy decoding never picks them, and
every consumer (mlx-lm, `mlx_lm.server`, the provider) runs to max_tokens with the EOS set it
reads from the folder. Everything else is byte for byte the model built without it.

`q_bits=4` (or 8) quantizes with `mlx_lm.utils.quantize_model`; the scales stay float32, which
keeps a quantized tiny model usable on CPU (half-precision scales are 10-50x slower there).

Building is deterministic: the same arguments give the same bytes. A marker file records the
builder version and the arguments, so a second call with the same arguments reuses the folder.

`tools=True` (`--tools`) gives the tokenizer two more special tokens, `<tool_call>` (3) and
`</tool_call>` (4), and a Qwen2.5-style chat template that renders `tools`, assistant `tool_calls`
and `tool` results: mlx-lm recognises the family (`json_tools` parser), so the folder is a
tool-calling model (its random weights call no tool by themselves).

The builder replaces only a folder it made (its marker file is in it, whatever its arguments), an
empty folder or nothing: any other path is refused (`FolderInUseError`) and left as it is.

CLI: ``python -m provider.tinymodel OUT [--preset tiny|small|medium|1b|8b] [--dtype float32]
[--q-bits 1|2|3|4|5|6|8 [--q-group-size 32|64|128]] [--seed 0] [--no-eos] [--tools] [--force]
[--check]``; ``--help`` lists the presets with their sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from provider.models.metadata import DType
from provider.units import human_bytes, table

# Bump whenever the output of the builder changes, so cached folders are rebuilt.
BUILDER_VERSION = 1
MARKER_FILE = ".tinymodel.json"

BOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, IM_START, EOS_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# `tools=True`: a Qwen2.5-style template that renders `tools` and tool turns, with `<tool_call>` and
# `</tool_call>` as tokens of their own (ids 3 and 4): mlx-lm recognises it as a `json_tools` family.
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'developer') or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DTYPES = ("float32", "bfloat16", "float16")
# What MLX's affine quantization (`mx.quantize`, the mode mlx-lm uses) accepts.
Q_BITS = (1, 2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)
MAX_SEED = 2**64 - 1  # `mx.random.seed` takes an unsigned 64-bit integer


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "float32"  # the weights' dtype when the caller names none


PRESETS: dict[str, Shape] = {
    "tiny": Shape(256, 2, 256, 4, 2, 2048, 2048),
    "small": Shape(512, 4, 1024, 8, 4, 6144, 4096),
    "medium": Shape(1024, 8, 2816, 16, 4, 8192, 4096),
    # Llama shapes at ~1B and ~8B for a GPU (MLX's CUDA backend batches bf16 matmuls, not 4-bit ones,
    # as measured on an H200).
    "1b": Shape(2048, 16, 8192, 32, 8, 32000, 8192, "bfloat16"),
    "8b": Shape(4096, 32, 14336, 32, 8, 32000, 8192, "bfloat16"),
}
EOS_IDS = (2, 0)  # <|im_end|>, <|endoftext|>: what config.json declares as eos_token_id


def parameter_count(shape: Shape) -> int:
    """Parameters of the preset's model: tied embedding, per-layer attention, MLP and norms."""
    head_dim = shape.hidden_size // shape.num_attention_heads
    attn = (2 * shape.hidden_size * shape.num_attention_heads * head_dim
            + 2 * shape.hidden_size * shape.num_key_value_heads * head_dim)
    per_layer = attn + 3 * shape.hidden_size * shape.intermediate_size + 2 * shape.hidden_size
    return shape.vocab_size * shape.hidden_size + shape.num_hidden_layers * per_layer + shape.hidden_size

# A small seeded corpus: pseudo-words from syllables, some real words and punctuation, and
# non-ASCII words so that multi-byte UTF-8 characters get their own merges.
_SYLLABLES = (
    "ka ro mi ne ta lu vo si pe da quo zen bar tel fin gor hul wix yam ost "
    "an er in on un al el il ol ul ar or ur ek ik ok ax ex ix ox"
).split()
_WORDS = (
    "the a of and to in is it that for on with as was at by this be from or an are not "
    "model token memory cache batch stream prompt reply coordinator provider request "
    "hello world answer question number apple river mountain blue green red yellow "
    "one two three four five six seven eight nine ten hundred thousand"
).split()
_UNICODE_WORDS = (
    "café naïve über straße señor façade crème brûlée smörgåsbord "
    "日本語 東京 漢字 中文 한국어 Ελληνικά русский язык مرحبا שלום "
    "😀 🚀 ✨ 🙂 🍎 ⭐ 你好 世界 数学"
).split()
_PUNCT = (".", ",", "!", "?", ";", ":", " -", "")
_CORPUS_LINES = 20_000


def _synthetic_corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(_CORPUS_LINES):
        words = []
        for _ in range(rng.randint(3, 14)):
            roll = rng.random()
            if roll < 0.45:
                words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
            elif roll < 0.85:
                words.append(rng.choice(_WORDS))
            elif roll < 0.95:
                words.append(rng.choice(_UNICODE_WORDS))
            else:
                words.append(str(rng.randint(0, 9999)))
        line = " ".join(words) + rng.choice(_PUNCT)
        lines.append(line[0].upper() + line[1:] if rng.random() < 0.5 else line)
    return lines


def train_tokenizer(vocab_size: int, seed: int, special_tokens: tuple[str, ...] = SPECIAL_TOKENS):
    """A byte-level BPE trained on the seeded synthetic corpus; `special_tokens` take ids 0, 1, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        # Seeding the full byte alphabet makes every UTF-8 string encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(seed), trainer=trainer)
    return tok


def _save_tokenizer(out: Path, vocab_size: int, seed: int, tools: bool = False) -> int:
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + ((TOOL_CALL_START, TOOL_CALL_END) if tools else ())
    hf = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, seed, specials),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=BOS_TOKEN,
        unk_token=None,
        chat_template=TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
        model_max_length=1_000_000,
    )
    hf.save_pretrained(str(out))
    # transformers 5 writes "TokenizersBackend", which transformers 4.x cannot resolve.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return len(hf)


def model_config(preset: str) -> dict:
    """The config.json a preset's folder gets, before the dtype (and quantization) are added."""
    return _model_config(PRESETS[preset])


def _model_config(shape: Shape) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": list(EOS_IDS),
    }


def lazy_weights(config: dict, dtype: str, seed: int, no_eos: bool = False) -> dict:
    """The model's weights as unevaluated MLX arrays (name -> array, in save order): nothing is
    computed or allocated until an array is evaluated."""
    from mlx.utils import tree_flatten

    return dict(tree_flatten(_lazy_model(config, dtype, seed, no_eos).parameters()))


def _lazy_model(config: dict, dtype: str, seed: int, no_eos: bool):
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # lazy: random draws are graph nodes
    # Small embeddings keep logits in a sane range for a tied random model.
    embed = model.model.embed_tokens.weight * 0.02
    if no_eos:
        embed[mx.array(EOS_IDS)] = 0.0  # tied: these tokens' logits are exactly 0
    model.model.embed_tokens.weight = embed
    target = getattr(mx, dtype)
    model.update(tree_map(lambda p: p.astype(target), model.parameters()))
    return model


def _save_weights(out: Path, config: dict, dtype: str, q_bits: int | None, q_group_size: int,
                  seed: int, no_eos: bool) -> dict:
    from mlx_lm.utils import quantize_model, save_config

    model = _lazy_model(config, dtype, seed, no_eos)
    config = dict(config, torch_dtype=dtype)
    if q_bits is not None:
        model, config = quantize_model(model, config, q_group_size, q_bits)
        _check_quantized(model, q_group_size)
    _write_shards(out, model)
    save_config(config, out / "config.json")
    return config


def _check_quantized(model, group_size: int) -> None:
    """mlx-lm quietly leaves a layer in float when its input size is not a multiple of the group size:
    a model that asked for quantization and has such a layer is an error, not a smaller success."""
    left = [name for name, module in model.named_modules() if hasattr(module, "to_quantized")]
    if left:
        raise ValueError(f"not quantized: {len(left)} layer(s) whose input size is not a multiple of the "
                         f"group size {group_size} ({', '.join(sorted(left)[:3])}{', ...' if len(left) > 3 else ''})")


def _write_shards(out: Path, model) -> None:
    """`mlx_lm.utils.save_model`'s files, byte for byte, from a lazy model: each tensor is computed
    just before its shard is written and freed after, so the model is never held twice."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import get_total_parameters, make_shards

    weights = dict(tree_flatten(model.parameters()))
    total_parameters = get_total_parameters(model)
    total_size = sum(v.nbytes for v in weights.values())
    shards = make_shards(weights)
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))  # the shards hold the only refs
    del weights
    name = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    weight_map = {}
    for i in range(len(shards)):
        shard, shards[i] = shards[i], None
        for array in shard.values():
            mx.eval(array)  # one at a time: a tensor's float32 draw is freed before the next one's
        shard_name = name.format(i + 1, len(shards))
        mx.save_safetensors(str(out / shard_name), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, shard_name))
        del shard
    index = {"metadata": {"total_size": total_size, "total_parameters": total_parameters},
             "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)


@dataclass(frozen=True)
class _Marker:
    builder_version: int
    preset: str
    dtype: str
    q_bits: int | None
    q_group_size: int
    seed: int
    no_eos: bool = False
    tools: bool = False

    def as_json(self) -> dict:
        # The options are written only when set, so folders built before them are still reused.
        fields = asdict(self)
        for option in ("no_eos", "tools"):
            if not fields[option]:
                del fields[option]
        return fields


def _marker_matches(out: Path, marker: _Marker) -> bool:
    path = out / MARKER_FILE
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()) == marker.as_json()
    except (OSError, ValueError):
        return False


class FolderInUseError(FileExistsError):
    """The output path holds something the builder did not make: it is left as it is."""


def check_replaceable(out: Path, marker_file: str) -> None:
    """Raise `FolderInUseError` unless `out` is absent, an empty folder, or a folder with the
    builder's `marker_file` in it (a folder it built, for any arguments)."""
    if out.is_symlink():
        raise FolderInUseError(f"{out} is a symbolic link; give the folder itself or a new path")
    if not out.exists():
        return
    if not out.is_dir():
        raise FolderInUseError(f"{out} exists and is not a folder; give an empty folder or a new path")
    if (out / marker_file).is_file() or not any(out.iterdir()):
        return
    raise FolderInUseError(f"{out} is a folder that this builder did not make (it has no {marker_file}) "
                           "and it is not empty; refusing to replace it: give an empty folder or a new path")


def build_folder(out: Path, marker_file: str, write: Callable[[Path], None],
                 done: Callable[[Path], bool]) -> Path:
    """Build a folder with `write(tmp)` under a fresh temporary name next to `out` and rename it into
    place, so a half-written folder is never seen or reused. Only an absent or empty `out`, or one the
    builder made (`marker_file`), is ever replaced (`check_replaceable`, before and after building);
    `done(out)`: another process finished the same build meanwhile, whose folder is kept."""
    check_replaceable(out, marker_file)
    target = Path(os.path.abspath(out))
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    stem = f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}"
    tmp, old = parent / f"{stem}.tmp", parent / f"{stem}.old"
    tmp.mkdir()  # a fresh name: nothing that was there before is ever deleted
    try:
        write(tmp)
        if done(out):
            return out
        check_replaceable(out, marker_file)
        if out.is_dir() and any(out.iterdir()):
            out.rename(old)  # ours (its marker is in it): moved aside, deleted once the new one is in place
            try:
                tmp.rename(out)
            except BaseException:
                old.rename(out)
                raise
        else:
            tmp.rename(out)  # absent, or an empty folder, which rename replaces
    finally:
        for path in (tmp, old):
            if path.exists():
                shutil.rmtree(path)
    return out


def build_tiny_model(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    dtype: str | None = None,
    q_bits: int | None = None,
    q_group_size: int = 64,
    seed: int = 0,
    no_eos: bool = False,
    tools: bool = False,
    force: bool = False,
) -> Path:
    """Build (or reuse) a tiny model folder at `out_dir` and return its path.

    `dtype`: None = the preset's (float32, bfloat16 for `1b` and `8b`). `no_eos`: greedy
    decoding never stops on an EOS token (see the module docstring). `tools`: the tool-calling chat
    template and its two tokens (see `TOOLS_CHAT_TEMPLATE`).

    The folder is reused when its marker says it was built by this builder version with
    the same arguments, unless `force` is set. The folder is built under a temporary name and
    renamed into place, so a half-written folder is never seen or reused. Only an absent or empty
    folder, or one this builder made, is replaced: anything else raises `FolderInUseError` (a
    `FileExistsError`) and is left untouched.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    dtype = dtype or PRESETS[preset].dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {DTYPES}")
    if q_bits is not None and q_bits not in Q_BITS:
        raise ValueError(f"unsupported q_bits {q_bits!r}; choose one of {Q_BITS}")
    if q_bits is not None and q_group_size not in Q_GROUP_SIZES:
        raise ValueError(f"unsupported q_group_size {q_group_size!r}; choose one of {Q_GROUP_SIZES}")
    check_seed(seed)
    out = Path(out_dir)
    marker = _Marker(BUILDER_VERSION, preset, dtype, q_bits, q_group_size, seed, no_eos, tools)
    if not force and _marker_matches(out, marker):
        return out

    def write(tmp: Path) -> None:
        shape = PRESETS[preset]
        _save_tokenizer(tmp, shape.vocab_size, seed, tools)
        _save_weights(tmp, _model_config(shape), dtype, q_bits, q_group_size, seed, no_eos)
        (tmp / MARKER_FILE).write_text(json.dumps(marker.as_json(), indent=2, sort_keys=True) + "\n")

    # Another process that finished the same build first: its folder is the same bytes.
    return build_folder(out, MARKER_FILE, write, lambda path: not force and _marker_matches(path, marker))


def weights_bytes(model_dir: str | Path) -> int:
    """Total size of the safetensors files in a model folder."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def _check(path: Path) -> str:
    import mlx_lm

    model, tok = mlx_lm.load(str(path))
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    return mlx_lm.generate(model, tok, ids, max_tokens=16)


def check_seed(seed: int) -> None:
    """Raise ValueError unless MLX can seed its generator with `seed`."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed {seed!r} is not between 0 and {MAX_SEED}")


def seed_argument(text: str) -> int:
    """`--seed`: an integer MLX can seed its generator with."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    try:
        check_seed(seed)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return seed


def presets_help() -> str:
    """A table of `PRESETS` for `--help`: each preset's shape and the size of its weights."""
    rows = [["preset", "hidden", "layers", "ffn", "heads/kv", "vocab", "context", "weights"]]
    rows += [[name, str(s.hidden_size), str(s.num_hidden_layers), str(s.intermediate_size),
              f"{s.num_attention_heads}/{s.num_key_value_heads}", str(s.vocab_size),
              str(s.max_position_embeddings), f"~{human_bytes(parameter_count(s) * DType(s.dtype).nbytes)} {s.dtype}"]
             for name, s in PRESETS.items()]
    # Quantized, a weight takes its bits plus 64 bits of float32 scale and bias per group.
    return ("presets (weights in the preset's dtype; with --q-bits B and the default group size 64,\n"
            "about B+1 bits a weight):\n" + "\n".join(table(rows, indent="  ")))


def run_builder(parser: argparse.ArgumentParser, out: Path, build: Callable[[], Path]) -> Path:
    """`build()` for a command line: an output path it may not replace is a usage error (exit 2), and
    any other OSError a one-line error naming `out` (exit 1); neither prints a traceback."""
    try:
        return build()
    except FolderInUseError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except OSError as e:
        # A file of the build's own (a temporary sibling of `out`) is not worth naming; any other is.
        inside = e.filename and os.path.abspath(e.filename).startswith(
            os.path.join(os.path.dirname(os.path.abspath(out)), ""))
        where = f" ({e.filename})" if e.filename and not inside else ""
        parser.exit(1, f"{parser.prog}: error: cannot write the model to {out}: {e.strerror or e}{where}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m provider.tinymodel", description=__doc__.split("\n")[0],
                                     epilog=presets_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path,
                        help="the model folder: absent, empty, or one this builder made (it is replaced)")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny", help="default: tiny (see below)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: the preset's")
    parser.add_argument("--q-bits", type=int, choices=Q_BITS, default=None,
                        help="quantize the weights to this many bits (scales stay float32)")
    parser.add_argument("--q-group-size", type=int, choices=Q_GROUP_SIZES, default=None,
                        help="weights per quantization scale, with --q-bits (default: 64)")
    parser.add_argument("--seed", type=seed_argument, default=0)
    parser.add_argument("--no-eos", action="store_true",
                        help="zero the EOS ids' embedding rows: greedy decoding runs to max_tokens")
    parser.add_argument("--tools", action="store_true",
                        help="a tool-calling chat template (Qwen2.5 style, <tool_call> tokens)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the folder matches the options")
    parser.add_argument("--check", action="store_true", help="load it with mlx_lm and generate 16 tokens")
    args = parser.parse_args(argv)
    if args.q_group_size is not None and args.q_bits is None:
        parser.error("--q-group-size needs --q-bits (without it nothing is quantized)")
    path = run_builder(parser, args.out, lambda: build_tiny_model(
        args.out, preset=args.preset, dtype=args.dtype, q_bits=args.q_bits,
        q_group_size=args.q_group_size or 64, seed=args.seed, no_eos=args.no_eos, tools=args.tools,
        force=args.force))
    print(f"{path}: {human_bytes(weights_bytes(path))} of weights"
          f"{' (EOS unreachable)' if args.no_eos else ''}")
    if args.check:
        print(repr(_check(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
