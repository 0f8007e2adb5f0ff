"""The ``register`` frame: the first frame of every connection.

Models: only those that can ever load under the memory cap are advertised (``FitResult.ever_fits``);
each carries its fit verdict as extra fields the Go coordinator ignores and a dashboard or the
coordinator double can read:

* ``fit_verdict`` — ``fits_now`` | ``fits_after_eviction`` | ``too_large`` (the latter when it fits an
  empty machine but not now, even after evicting idle models);
* ``estimated_memory_gb`` ([N] field) — padded weights estimate; ``required_memory_gb`` — that plus the
  load headroom, what the load gate checks.

Routability on a self-hosted [A] coordinator also needs ``backend: inprocess-mlx``, our X25519
``public_key`` (standard base64), ``encrypted_response_chunks: true``, ``privacy_capabilities`` and
a ``runtime_hash`` on its manifest; ``version`` is the installed package version. ``attestation``,
when the posture allows one (``provider.session.attestation``), is the signed blob that earns trust
``self_signed``; it is a ``RawJSON`` and reaches the wire byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from memory import FitResult
from memory.policy import GiB
from protocol import Hardware, ModelInfo, PrivacyCapabilities, RawJSON, Register
from protocol._wire import Float, Str
from provider.models import ModelInfo as LocalModel


class AdvertisedModel(ModelInfo):
    """``models[]`` entry with our fit verdict as extra fields (unknown to Go, ignored there)."""

    fit_verdict: Str
    required_memory_gb: Float


class RegisterFrame(Register):
    """``Register`` whose models keep their extra fields on the wire."""

    models: tuple[AdvertisedModel, ...]


def quantization_label(model: LocalModel) -> str:
    """``4bit`` style for quantized weights (as the reference providers send), else the dtype."""
    if model.quantization is not None:
        return f"{model.quantization.bits}bit"
    return model.dtype.value


def advertised_models(
    verdicts: Iterable[tuple[LocalModel, FitResult]],
    weight_hashes: Mapping[str, str] | None = None,
) -> tuple[AdvertisedModel, ...]:
    """The models that can ever load here (``ModelManager.verdicts()`` order), each with its verdict."""
    hashes = weight_hashes or {}
    out = []
    for model, verdict in verdicts:
        if not verdict.ever_fits:
            continue
        out.append(AdvertisedModel(
            id=model.id,
            size_bytes=model.weight_bytes,
            model_type=model.model_type,
            quantization=quantization_label(model),
            weight_hash=hashes.get(model.id, ""),
            is_vision=model.is_vision,  # served through mlx-vlm; the verdict's weights include the vision tower
            estimated_memory_gb=round(verdict.weights_bytes / GiB, 3),
            fit_verdict=verdict.verdict.value,
            required_memory_gb=round(verdict.required_bytes / GiB, 3),
        ))
    return tuple(out)


def build_register(
    *,
    hardware: Hardware,
    models: tuple[AdvertisedModel, ...],
    backend: str,
    public_key: str,
    version: str,
    runtime_hash: str,
    privacy: PrivacyCapabilities,
    auth_token: str | None = None,
    attestation: RawJSON | None = None,
    prefill_tps: float = 0.0,
    decode_tps: float = 0.0,
) -> RegisterFrame:
    return RegisterFrame(
        hardware=hardware,
        models=models,
        backend=backend,
        version=version,
        public_key=public_key,
        encrypted_response_chunks=True,
        auth_token=auth_token or "",
        runtime_hash=runtime_hash,
        privacy_capabilities=privacy,
        attestation=attestation,
        prefill_tps=round(max(0.0, prefill_tps), 3),  # 0: none measured yet, omitted
        decode_tps=round(max(0.0, decode_tps), 3),
    )


__all__ = ["AdvertisedModel", "RegisterFrame", "advertised_models", "build_register", "quantization_label"]
