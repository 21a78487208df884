"""How a run's grant is kept in ``fleet_runs.run_grants``: packed, at about a third of its size.

A grant is a compact JWS (three base64url parts) of about 830 characters, most of it claim names and
values every grant repeats, written three characters for every two bytes. Kept as it is, it was the
largest single record of a run a caller submitted (902 of 5,766 bytes of a parked run). Packed, it
is the header and the claims decoded and deflated against a dictionary of what grants repeat, and
the signature's 64 bytes as they are: about 300 bytes.

The packing is lossless and checked: a grant is packed only if unpacking gives back the very same
token (so a token encoded in any other way than the registry's is kept as it is), and what is
unpacked is verified as any token is, by whoever redeems it. The first byte says the format:
:data:`PACKED_V1`, or a token as text (a JWS begins with ``e``, the base64 of ``{"``), which is how a
grant stored before packing reads.
"""

from __future__ import annotations

import base64
import struct
import zlib

PACKED_V1 = 1
# What every run grant repeats (see registry._token_service): claim names, the header, fixed values.
# Changing it makes a new format: a grant packed against one dictionary is read with that one.
_DICTIONARY_V1 = (
    b'{"alg":"ES256","kid":"","typ":"run-grant+jwt"}'
    b'{"iss":"fleet-registry","sub":"operator","client_id":"coordinator","aud":"coordinator",'
    b'"tenant":"","scope":"agent:invoke","iat":17,"nbf":17,"exp":17,"jti":"","client_kid":"",'
    b'"act":{"sub":"coordinator"},"chain_kids":[""],"sub_kind":"operator","run_id":"","token_use":"run_grant"}'
)
_LENGTHS = struct.Struct(">HH")  # of the header and the claims, before the signature


def _b64decode(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def pack_grant(token: str) -> bytes:
    """``token`` as stored: packed if that loses nothing, else its text."""
    packed = _packed(token)
    return packed if packed is not None and unpack_grant(packed) == token else token.encode("utf-8")


def _packed(token: str) -> bytes | None:
    try:
        header, claims, signature = (_b64decode(part) for part in token.split("."))
    except ValueError:  # not three parts, or not base64
        return None
    if not header or not claims or len(header) >= 1 << 16 or len(claims) >= 1 << 16:
        return None
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_DEFAULT_STRATEGY, _DICTIONARY_V1)
    body = deflate.compress(_LENGTHS.pack(len(header), len(claims)) + header + claims + signature)
    return bytes([PACKED_V1]) + body + deflate.flush()


def unpack_grant(stored: bytes) -> str:
    """The token ``stored`` holds (either format)."""
    if not stored or stored[0] != PACKED_V1:
        return bytes(stored).decode("utf-8")
    inflate = zlib.decompressobj(-15, _DICTIONARY_V1)
    raw = inflate.decompress(bytes(stored[1:])) + inflate.flush()
    header_len, claims_len = _LENGTHS.unpack_from(raw)
    start = _LENGTHS.size
    header, claims = (
        raw[start : start + header_len],
        raw[start + header_len : start + header_len + claims_len],
    )
    signature = raw[start + header_len + claims_len :]
    return ".".join(_b64encode(part) for part in (header, claims, signature))
