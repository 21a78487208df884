"""Governed tiered memory (episodic, semantic, procedural): every write passes PII and secret detection
and a policy decision before it is committed; every read passes policy. See :mod:`memory.gate`."""

import os

# tldextract (under presidio's e-mail recognizer) reads this when it is imported, and without it
# fetches the public suffix list from the internet on first use. Its bundled snapshot is used instead.
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
# onnxruntime (the local embedding model) reports telemetry by default from 1.29 on: it resolves a
# host and writes under ~/.cache. Memory runs offline and tells no one what it embeds.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__all__: list[str] = []
