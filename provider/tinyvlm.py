"""A tiny offline vision-language model for tests and benchmarks (needs the `vision` extra).

`build_tiny_vlm` writes a complete Gemma-3 style model folder in the normal MLX / Hugging Face
layout that `mlx_vlm.load(path)` loads unchanged, with nothing downloaded:

* `config.json`: `model_type: gemma3` with a `text_config` (`gemma3_text`: 2 layers, one sliding,
  one full attention) and a `vision_config` (a SigLIP tower: 64×64 images, 8×8 patches);
  `mm_tokens_per_image` soft tokens per image (the projector average-pools the 8×8 patch grid);
* `model.safetensors`: a seeded random init of `mlx_vlm.models.gemma3.Model` (language model,
  vision tower and projector), float32. The rows of `<eos>` and `<end_of_turn>` in the (tied)
  embedding are zero, so their logit is always 0 while the best of the 2046 others is positive:
  greedy decoding never stops by itself, whatever the BLAS (tests that run the model in another
  process cannot override the EOS ids as the in-process ones do);
* `processor_config.json` (`image_seq_length`, the soft tokens per image, as Gemma checkpoints
  state it) and `preprocessor_config.json` (resize to 64×64, rescale, normalise);
* a byte-level BPE tokenizer trained on the tiny-model corpus (`provider.tinymodel`) with Gemma's
  special tokens: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<start_of_turn>` 3, `<end_of_turn>` 4,
  `<start_of_image>` 5, `<end_of_image>` 6, `<image_soft_token>` 7 (named in
  `extra_special_tokens`, which is how the Gemma-3 processor finds them), and a Gemma-style chat
  template in `chat_template.jinja`.

Deterministic: the same arguments give the same bytes; a marker file lets a second call reuse the
folder. Only a folder the builder made, an empty folder or nothing is replaced: any other path is
refused and left as it is. CLI: ``python -m provider.tinyvlm OUT [--seed 0] [--force] [--check]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from provider.tinymodel import build_folder, check_seed, run_builder, seed_argument, train_tokenizer
from provider.units import human_bytes

BUILDER_VERSION = 2
MARKER_FILE = ".tinyvlm.json"

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
SPECIAL_TOKENS = (PAD, EOS, BOS, START_OF_TURN, END_OF_TURN, BOI, EOI, IMAGE_TOKEN)
EOS_IDS = (1, 4)  # <eos>, <end_of_turn>
IMAGE_TOKEN_ID = 7

# Gemma's template: a system message is folded into the first user turn, the assistant is "model".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if loop.first %}{{ system }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class VlmShape:
    hidden_size: int = 128
    num_hidden_layers: int = 2
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    sliding_window: int = 512
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_intermediate_size: int = 128
    vision_heads: int = 2
    image_size: int = 64
    patch_size: int = 8
    mm_tokens_per_image: int = 16


def _text_config(s: VlmShape) -> dict:
    return {
        "model_type": "gemma3_text",
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_hidden_layers,
        "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings,
        "sliding_window": s.sliding_window,
        "sliding_window_pattern": 2,  # layer 0 sliding, layer 1 full attention
        "query_pre_attn_scalar": s.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_global_base_freq": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "mm_tokens_per_image": s.mm_tokens_per_image,
        "torch_dtype": "float32",
    }


def _vision_config(s: VlmShape) -> dict:
    return {
        "model_type": "siglip_vision_model",
        "hidden_size": s.vision_hidden_size,
        "num_hidden_layers": s.vision_layers,
        "intermediate_size": s.vision_intermediate_size,
        "num_attention_heads": s.vision_heads,
        "image_size": s.image_size,
        "patch_size": s.patch_size,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
    }


def _model_config(s: VlmShape) -> dict:
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": _text_config(s),
        "vision_config": _vision_config(s),
        "hidden_size": s.hidden_size,
        "vocab_size": s.vocab_size,
        "image_token_index": IMAGE_TOKEN_ID,
        "boi_token_index": 5,
        "eoi_token_index": 6,
        "mm_tokens_per_image": s.mm_tokens_per_image,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": list(EOS_IDS),
        "torch_dtype": "float32",
    }


def _save_tokenizer(out: Path, vocab_size: int, seed: int) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, seed, SPECIAL_TOKENS),
        bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=None,
        model_max_length=1_000_000,
    )
    hf.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # The Gemma-3 processor reads these as tokenizer attributes (image_token, image_token_id, ...).
    cfg["extra_special_tokens"] = {"image_token": IMAGE_TOKEN, "boi_token": BOI, "eoi_token": EOI}
    cfg["add_bos_token"] = False  # the chat template writes <bos>
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _save_processor(out: Path, s: VlmShape) -> None:
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": s.mm_tokens_per_image},
        indent=2, sort_keys=True) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "size": {"height": s.image_size, "width": s.image_size},
        "do_resize": True,
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
    }, indent=2, sort_keys=True) + "\n")


def _save_weights(out: Path, config: dict, seed: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_vlm.models import gemma3
    from mlx_vlm.utils import save_config

    mx.random.seed(seed)
    model = gemma3.Model(gemma3.ModelConfig.from_dict({
        **config,
        "text_config": gemma3.TextConfig.from_dict(config["text_config"]),
        "vision_config": gemma3.VisionConfig.from_dict(config["vision_config"]),
    }))
    # Small embeddings keep a tied random model's logits in a sane range.
    embed = model.language_model.model.embed_tokens
    embed.weight = embed.weight * 0.02
    never = mx.zeros((embed.weight.shape[0], 1)).at[mx.array(list(EOS_IDS))].add(1.0)
    embed.weight = embed.weight * (1.0 - never)  # greedy never picks <eos> / <end_of_turn>
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, out / "config.json")


@dataclass(frozen=True)
class _Marker:
    builder_version: int
    seed: int
    shape: dict


def _marker_matches(out: Path, marker: _Marker) -> bool:
    path = out / MARKER_FILE
    try:
        return path.is_file() and json.loads(path.read_text()) == asdict(marker)
    except (OSError, ValueError):
        return False


def build_tiny_vlm(out_dir: str | Path, *, seed: int = 0, shape: VlmShape = VlmShape(),
                   force: bool = False) -> Path:
    """Build (or reuse) the tiny VLM folder at `out_dir` and return its path (atomic rename).

    Only an absent or empty folder, or one this builder made (its marker file is in it), is
    replaced: anything else raises `provider.tinymodel.FolderInUseError` and is left untouched."""
    check_seed(seed)
    out = Path(out_dir)
    marker = _Marker(BUILDER_VERSION, seed, asdict(shape))
    if not force and _marker_matches(out, marker):
        return out

    def write(tmp: Path) -> None:
        _save_tokenizer(tmp, shape.vocab_size, seed)
        _save_processor(tmp, shape)
        _save_weights(tmp, _model_config(shape), seed)
        (tmp / MARKER_FILE).write_text(json.dumps(asdict(marker), indent=2, sort_keys=True) + "\n")

    return build_folder(out, MARKER_FILE, write, lambda path: not force and _marker_matches(path, marker))


def _check(path: Path) -> str:
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    model, processor = load(str(path))
    prompt = apply_chat_template(processor, model.config, "describe this", num_images=1)
    image = Image.new("RGB", (40, 30), (200, 30, 30))
    return generate(model, processor, prompt, image=[image], max_tokens=16, temperature=0.0).text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m provider.tinyvlm", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path,
                        help="the model folder: absent, empty, or one this builder made (it is replaced)")
    parser.add_argument("--seed", type=seed_argument, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even when the folder matches the options")
    parser.add_argument("--check", action="store_true", help="load it with mlx_vlm and describe an image")
    args = parser.parse_args(argv)
    path = run_builder(parser, args.out, lambda: build_tiny_vlm(args.out, seed=args.seed, force=args.force))
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    print(f"{path}: {human_bytes(size)} of weights")
    if args.check:
        print(repr(_check(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
