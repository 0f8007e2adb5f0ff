"""protocol.crypto: X25519 identity, per-request NaCl box, strict base64, key files."""

from __future__ import annotations

import base64
import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol.crypto as crypto
from protocol import EncryptedPayload, InferenceResponseChunk, decode, encode
from protocol.crypto import (
    DecryptError,
    InvalidKeyError,
    KeyFileError,
    ProviderIdentity,
    b64decode_strict,
    parse_public_key,
)

PK_P = "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV/Wm2rSU="


@pytest.fixture
def provider() -> ProviderIdentity:
    return ProviderIdentity.generate()


@pytest.fixture
def session() -> ProviderIdentity:
    """Stands in for the coordinator's per-request session key pair."""
    return ProviderIdentity.generate()


def _request(session: ProviderIdentity, provider: ProviderIdentity, body: bytes) -> EncryptedPayload:
    return session.box_for(provider.public_key_b64).seal(body)


def test_public_key_is_standard_padded_base64_of_32_bytes(provider):
    key = provider.public_key_b64
    assert len(key) == 44 and key.endswith("=")
    assert base64.b64decode(key, validate=True) == bytes(parse_public_key(key))
    assert ProviderIdentity.from_private_bytes(provider.private_bytes()).public_key_b64 == key


def test_request_opens_and_chunks_seal_back_to_the_session(provider, session):
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    box, plaintext = provider.open_request(_request(session, provider, body))
    assert plaintext == body
    frame = box.seal_chunk("req-1", b"data: {}\n\n")
    assert frame.encrypted_data.ephemeral_public_key == provider.public_key_b64  # the registered string
    assert frame.data == ""
    wire = decode(encode(frame))
    assert isinstance(wire, InferenceResponseChunk)
    coordinator_side = session.box_for(wire.encrypted_data.ephemeral_public_key)
    assert coordinator_side.open(wire.encrypted_data.ciphertext) == b"data: {}\n\n"


def test_every_seal_uses_a_fresh_nonce(provider, session):
    box = provider.box_for(session.public_key_b64)
    sealed = [base64.b64decode(box.seal(b"same").ciphertext) for _ in range(20)]
    nonces = {s[:24] for s in sealed}
    assert len(nonces) == 20
    assert all(len(s) == 24 + 16 + 4 for s in sealed)


def test_one_precomputed_box_per_request(provider, session, monkeypatch):
    built = []
    real_box = crypto.Box

    def counting_box(*args):
        built.append(args)
        return real_box(*args)

    request = _request(session, provider, b"{}")
    monkeypatch.setattr(crypto, "Box", counting_box)
    box, _ = provider.open_request(request)
    for index in range(50):
        box.seal_chunk("r", f"data: {index}\n\n".encode())
    assert len(built) == 1


@pytest.mark.parametrize(
    "key",
    [
        "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV_Wm2rSU=",  # URL-safe alphabet
        "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV/Wm2rSU",  # unpadded
        "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV_Wm2rSU",  # both (Go: illegal base64 data)
        " tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV/Wm2rSU=",
        "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV/Wm2rS==",  # 31 bytes
        base64.b64encode(bytes(33)).decode(),
        "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV/Wm2rSV=",  # non-canonical trailing bits
        "ümlaut==",
        "",
        base64.b64encode(bytes(32)).decode(),  # low-order points: the shared secret would be all zero
        base64.b64encode(b"\x01" + bytes(31)).decode(),
        "4Ot6fDtBuK4WVuP68Z/EatoJjeucMrH9hmIFFl9JuAA=",
    ],
)
def test_malformed_keys_are_refused(provider, key):
    with pytest.raises(InvalidKeyError) as caught:
        provider.box_for(key)
    assert key.strip() not in str(caught.value) or not key


def test_registered_key_vector_parses():
    assert len(bytes(parse_public_key(PK_P))) == 32


def test_strict_base64_helper():
    assert b64decode_strict("YWI=") == b"ab"
    for bad in ["YWI", "YW I=", "YW-_", "YWI=\n", "YWJj="]:
        with pytest.raises(ValueError):
            b64decode_strict(bad)


def test_tampered_wrong_key_short_and_urlsafe_ciphertexts_are_clean_errors(provider, session):
    payload = _request(session, provider, b"secret body")
    sealed = bytearray(base64.b64decode(payload.ciphertext))
    sealed[-1] ^= 0x80
    cases = [
        payload.model_copy(update={"ciphertext": base64.b64encode(sealed).decode()}),  # tampered
        payload.model_copy(update={"ciphertext": base64.b64encode(bytes(39)).decode()}),  # shorter than overhead
        payload.model_copy(update={"ciphertext": payload.ciphertext.rstrip("=")}) if "=" in payload.ciphertext
        else payload.model_copy(update={"ciphertext": payload.ciphertext + "="}),
        payload.model_copy(update={"ciphertext": base64.urlsafe_b64encode(b"\xfb\xff" * 30).decode()}),
    ]
    for bad in cases:
        with pytest.raises(DecryptError) as caught:
            provider.open_request(bad)
        assert bad.ciphertext not in str(caught.value)
    stranger = ProviderIdentity.generate()
    with pytest.raises(DecryptError):
        stranger.open_request(payload)


@settings(max_examples=25, deadline=None)
@given(st.binary(max_size=2048))
def test_seal_open_round_trip(plaintext):
    provider, session = ProviderIdentity.generate(), ProviderIdentity.generate()
    box, opened = provider.open_request(session.box_for(provider.public_key_b64).seal(plaintext))
    assert opened == plaintext
    assert session.box_for(provider.public_key_b64).open(box.seal(plaintext).ciphertext) == plaintext


# --- key files -----------------------------------------------------------------------------------------------


def test_save_writes_0600_atomically_and_load_round_trips(tmp_path, provider):
    path = tmp_path / "provider.key"
    old_umask = os.umask(0)  # a permissive umask must not widen the file
    try:
        provider.save(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["provider.key"]  # no temp file left behind
    assert ProviderIdentity.load(path).public_key_b64 == provider.public_key_b64
    replacement = ProviderIdentity.generate()
    replacement.save(path)
    assert ProviderIdentity.load(path).public_key_b64 == replacement.public_key_b64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_load_refuses_a_key_others_can_read(tmp_path, provider):
    path = tmp_path / "provider.key"
    provider.save(path)
    path.chmod(0o644)
    with pytest.raises(KeyFileError):
        ProviderIdentity.load(path)


@pytest.mark.parametrize("content", [b"", b"not base64!\n", base64.b64encode(bytes(31)) + b"\n", b"\xff\xfe"])
def test_load_refuses_malformed_key_files(tmp_path, content):
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(KeyFileError):
        ProviderIdentity.load(path)


def test_load_of_a_missing_file_is_a_key_file_error(tmp_path):
    with pytest.raises(KeyFileError):
        ProviderIdentity.load(tmp_path / "absent.key")


def test_private_key_must_be_32_bytes():
    with pytest.raises(InvalidKeyError):
        ProviderIdentity.from_private_bytes(bytes(31))


def test_a_temp_file_a_killed_writer_left_never_blocks_the_next_write(tmp_path):
    """A writer killed between its temp file and the rename leaves the temp file behind; a later
    process (which may get the same pid after a reboot) must still write (the crash-loop guard's
    files and the identity keys go through here)."""
    import os

    from protocol.crypto import write_private_file

    target = tmp_path / "abnormal-exits.json"
    (tmp_path / f".{target.name}.{os.getpid()}.tmp").write_bytes(b"half")
    write_private_file(target, b"{}")
    write_private_file(target, b'{"exits": []}')
    assert target.read_bytes() == b'{"exits": []}' and oct(target.stat().st_mode & 0o777) == "0o600"
