"""provider.slots.admission for vision models: the whole KV span plus media, half the hard cap,
at most N requests with images per model, images refused for text models (pure, no MLX)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from memory import GiB, MemorySnapshot, figures
from memory.media import projected_decode_bytes
from protocol.errors import ErrorReason, FailureCode, RejectionReason
from provider.models import DType, KvAccuracy, KvLayout, ModelInfo, ModelSource, VisionInfo, kv_bytes_for_tokens
from provider.slots import Admitted, ManagerView, ModelState, Refused, SlotView, decide
from provider.slots.admission import vision_need

MiB = 2**20
FIG = figures(16 * GiB, env={}, memory_reserve_gb=4.0, activation_reserve_gb=3.0, cap_fraction=0.9)


def vlm(model_id: str = "vlm", *, per_token: int = MiB, soft: int | None = 256, context: int = 8192) -> ModelInfo:
    layout = KvLayout(dtype_bytes=2, full_layers=1, bytes_per_token=per_token, sliding=(), recurrent_layers=0,
                      accuracy=KvAccuracy.EXACT)
    return ModelInfo(model_id, Path("/models") / model_id, ModelSource.MODEL_DIR, None, (), GiB, "gemma3", None,
                     DType.FLOAT16, context, layout, vision=VisionInfo(soft, 100 * MiB))


def text_model() -> ModelInfo:
    return dataclasses.replace(vlm("text"), vision=None, model_type="llama")


def loaded(model_id: str = "vlm") -> SlotView:
    return SlotView(model_id, ModelState.LOADED, False, 0.0, int(1.2 * GiB))


def view(*slots: SlotView, outstanding: int = 0, vision_requests: dict | None = None, limit: int = 2) -> ManagerView:
    return ManagerView({s.model_id: s for s in slots}, 3, False, outstanding, 0, 0, limit, vision_requests or {})


def snap(active: int = int(1.2 * GiB)) -> MemorySnapshot:
    return MemorySnapshot(physical_bytes=16 * GiB, available_bytes=16 * GiB - active, mlx_active_bytes=active)


def admit(v: ManagerView, info: ModelInfo, *, prompt: int = 100, max_tokens: int | None = 200, images: int = 0,
          media: int = 0, s: MemorySnapshot | None = None):
    return decide(v, FIG, s or snap(), model_id=info.id, info=info, prompt_tokens=prompt, max_tokens=max_tokens,
                  images=images, media_bytes=media)


def test_images_for_a_text_model_are_415():
    r = admit(view(), text_model(), images=1, media=MiB)
    assert isinstance(r, Refused) and r.status_code == 415 and r.failure_code is FailureCode.UNSUPPORTED_MEDIA


def test_the_reservation_is_the_whole_span_plus_media():
    info = vlm()
    media = projected_decode_bytes([(800, 600), (1024, 768)])
    r = admit(view(loaded()), info, prompt=100, max_tokens=200, images=2, media=media)
    assert isinstance(r, Admitted) and not r.cold and r.vision is not None
    assert r.vision.span.tokens == 100 + 2 * 256 + 200  # not the output alone (the seed's false admit)
    assert r.kv.tokens == r.vision.span.tokens and r.kv.max_tokens == 200
    assert r.vision.kv_bytes == kv_bytes_for_tokens(info.kv, 812)
    assert r.vision.total_bytes == r.vision.kv_bytes + media


def test_unstated_soft_tokens_use_1024():
    need = vision_need(FIG, vlm(soft=None), 50, 10, images=3, media_bytes=0)
    assert need.span.tokens == 50 + 3 * 1024 + 10


def test_media_and_kv_above_half_the_hard_cap_is_refused_as_bigger_than_this_node():
    info = vlm()
    kv = vision_need(FIG, info, 100, 200, images=1, media_bytes=0).kv_bytes
    room = FIG.single_request_limit_bytes - kv
    fits = admit(view(loaded()), info, images=1, media=room, s=snap())
    assert not (isinstance(fits, Refused) and fits.error_reason is ErrorReason.REQUEST_EXCEEDS_NODE)
    over = admit(view(loaded()), info, images=1, media=room + 1)
    assert isinstance(over, Refused) and over.status_code == 503
    assert over.error_reason is ErrorReason.REQUEST_EXCEEDS_NODE and over.rejection_reason is RejectionReason.MEMORY_CAP


def test_media_counts_against_the_room_of_a_loaded_model():
    """available = eff_cap 12 − 1.2 resident − 3 A − 3 outstanding = 4.8 GiB: the KV alone fits,
    KV + media of 5 GiB in total does not (though it is under half the hard cap)."""
    info = vlm()
    busy = view(loaded(), outstanding=3 * GiB)
    kv_only = admit(busy, info, images=1, media=0)
    assert isinstance(kv_only, Admitted)
    r = admit(busy, info, images=1, media=5 * GiB - kv_only.vision.kv_bytes)
    assert isinstance(r, Refused) and r.status_code == 503
    assert r.rejection_reason in (RejectionReason.KV_HEADROOM, RejectionReason.TOKEN_BUDGET)


def test_at_most_n_requests_with_images_per_model_then_fast_503():
    info = vlm()
    busy = view(loaded(), vision_requests={"vlm": 2}, limit=2)
    r = admit(busy, info, images=1, media=MiB)
    assert isinstance(r, Refused) and r.status_code == 503
    assert r.error_reason is ErrorReason.QUEUE_FULL and r.rejection_reason is RejectionReason.SLOT_STATE
    assert isinstance(admit(busy, info, images=0), Admitted)  # text on the VLM is not a vision request
    assert isinstance(admit(view(loaded(), vision_requests={"vlm": 1}), info, images=1, media=MiB), Admitted)
    # The count is seen even while the model is not loaded (a cold storm is capped too).
    cold = view(vision_requests={"vlm": 2})
    assert isinstance(admit(cold, info, images=1, media=MiB), Refused)


def test_a_cold_vision_model_plans_its_load_with_the_whole_reservation():
    info = vlm()
    r = admit(view(), info, images=2, media=GiB)
    assert isinstance(r, Admitted) and r.cold
    # 5 GiB of media on top of the load's own needs does not fit under the 12 GiB cap.
    r = admit(view(), info, images=2, media=int(6.5 * GiB))
    assert isinstance(r, Refused) and r.status_code == 503
