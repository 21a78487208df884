"""Settings, built once at each entry point from ``FLEET_*`` environment variables and passed down.

Library code never reads the environment; it takes a settings object or plain arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import AliasChoices, BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet import transport
from fleet.errors import FleetError

DEFAULT_ISSUER = "fleet-registry"


class ExternalIssuer(BaseModel):
    """An identity provider outside the fleet whose access tokens the coordinator accepts (from
    ``FLEET_EXTERNAL_ISSUERS``, a JSON list of these). Its tokens are verified against its JWKS
    and mapped: the caller becomes ``NAME:SUB``, acts in ``tenant`` (whatever the token claims)
    with ``scopes`` (the provider authenticates; this mapping authorises)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    issuer: str = Field(min_length=1)
    jwks_url: str = Field(pattern=r"^https?://")
    audience: str = Field(min_length=1, description="the aud its tokens must name for this fleet")
    tenant: str = Field(min_length=1)
    scopes: list[str] = Field(default_factory=lambda: ["agent:invoke"])
    algorithms: list[str] = Field(default_factory=lambda: ["ES256", "RS256"])
    max_lifetime_s: int = Field(default=3600, gt=0, description="refuse tokens that live longer")

    def principal(self, sub: str) -> str:
        return f"{self.name}:{sub}"


class FleetSettings(BaseSettings):
    """What an operator or a CLI invocation needs to know about a stack."""

    model_config = SettingsConfigDict(env_prefix="FLEET_", extra="ignore")

    home: Path = Field(default=Path(".fleet"), description="the data dir of the local stack")
    nats_url: str | None = Field(default=None, description="use this NATS instead of starting one")
    nats_replicas: int = Field(
        default=1, ge=1, le=5, description="with nats_url: the replicas of the streams the services create"
    )
    nats_keys_dir: Path | None = Field(
        default=None,
        description="with nats_url: the keys that bus trusts (fleet.buskeys; python -m deploy.nats_cluster"
        " prints them)",
    )
    workers: int = Field(default=2, ge=1, le=64, description="how many worker processes to start")
    tls: bool = Field(default=False, description="NATS and every service over TLS, on a CA of the data dir's")
    pg_dsn: str | None = Field(default=None, description="use this Postgres instead of starting one")
    log_level: str = "info"
    fork_server: bool = Field(
        default=True,
        description="fork every service from one process that imported the platform's code once (less"
        " memory, a faster start); false: start each as its own interpreter",
    )
    manifest: Path | None = Field(
        default=None, description="a fleet manifest (fleet.toml) whose services to run; default ./fleet.toml"
    )


class ServiceSettings(BaseSettings):
    """What one service process needs: who it is, where it listens, where the others are."""

    model_config = SettingsConfigDict(env_prefix="FLEET_", extra="ignore")

    service_id: str
    workflows: dict[str, str] = Field(
        default_factory=dict,
        description="the workflows a project registers (name: module:function building its StateGraph), JSON;"
        " the coordinator offers them, the workers run them",
    )
    home: Path = Path(".fleet")
    key_file: Path
    listen_fd: int | None = Field(default=None, description="an inherited, bound, listening socket")
    host: str = "127.0.0.1"
    port: int = 0
    public_url: str = Field(description="the base URL others reach this service at")
    registry_url: str = ""
    issuer: str = DEFAULT_ISSUER
    nats_url: str = Field(default="", description="one NATS URL, or a cluster's servers separated by commas")
    nats_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="replicas of every stream, KV bucket and object store this service creates"
        " (3 on a three-node cluster)",
    )
    nats_keys_dir: Path | None = Field(
        default=None,
        description="the registry only: the bus's nkeys (callout issuer, responder, system user), which"
        " make it the bus's authority (see registry._callout)",
    )
    tenant_key_master_file: Path | None = Field(
        default=None,
        description="the registry only: the master secret of the tenant keys (made on first start;"
        " default: tenant-key-master.json in its state dir). Losing it loses every artifact",
    )
    tls_ca_file: Path | None = Field(
        default=None, description="the CA that signed the bus's (and the services') TLS certificates"
    )
    a2a_grpc_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="an A2A service: also serve A2A's gRPC binding on this port (0: any free one), named"
        " in its card (fleet.a2a_grpc); none: JSON-RPC and HTTP+JSON only",
    )
    tls_cert_file: Path | None = Field(default=None, description="serve HTTPS with this certificate (PEM)")
    tls_key_file: Path | None = Field(default=None, description="and this key (PEM)")
    pg_dsn: str = ""
    mcp_max_result_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1,
        description="an MCP server's: the bytes of one tool result (as JSON) it answers at most",
    )
    enrollment_token: str = ""
    operator_jwk_file: Path | None = Field(
        default=None, description="the operator's public key: the root of trust of every verifier"
    )
    issuer_cert_file: Path | None = Field(
        default=None, description="the registry's: the operator's certificate for its signing key"
    )
    policy_dir: Path | None = None
    policy_engine: Literal["embedded", "opa"] = Field(
        default="embedded", description="where decisions are evaluated: in process, or an OPA server"
    )
    opa_url: str = Field(default="", description="the OPA server of the opa engine, http(s)://host:port")
    opa_token: str = Field(default="", description="a bearer token for that OPA server, if it wants one")
    policy_timeout_s: float = Field(default=2.0, gt=0, description="a decision not made by then is a denial")
    metrics_every_s: float = Field(
        default=15.0,
        ge=0.5,
        le=300.0,
        description="how often the process publishes its metrics' snapshot on fleet.metrics.<process>"
        " (the console's charts)",
    )
    log_level: str = "info"
    max_body_bytes: int = Field(
        default=1024 * 1024,
        gt=0,
        description="the largest request body any route takes, A2A JSON-RPC included (larger: 413"
        " body_too_large)",
    )
    max_mcp_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        gt=0,
        description="the largest request body of an MCP server's /mcp route (the MCP SDK's own limit;"
        " a memory batch of 256 texts of 16,000 characters needs it)",
    )
    state_dir: Path | None = Field(default=None, description="where this service keeps local state")
    heartbeat_s: float = Field(
        default=20.0, description="a specialist's heartbeat to its caller while a skill works (0: none)"
    )
    card_refresh_s: float = Field(
        default=30.0, description="the registry checks every agent's card again this often (0: never)"
    )
    llm_base_url: str = Field(
        default="",
        description="an OpenAI-compatible endpoint (e.g. http://host:8000/v1); empty: no LLM, skills and"
        " plans stay deterministic",
    )
    llm_model: str = Field(default="", description="the model name sent to that endpoint")
    llm_api_key: str = Field(
        default="", repr=False, description="its bearer key, if it wants one (never logged)"
    )
    llm_timeout_s: float = Field(default=60.0, gt=0, description="one chat completion may take this long")
    llm_max_turns: int = Field(default=8, gt=0, description="model turns of one skill's agent loop")
    llm_context_tokens: int = Field(
        default=32_000,
        ge=1_000,
        description="the model's context window: the agent loop compacts at 3/4 of it",
    )
    external_issuers: list[ExternalIssuer] = Field(
        default_factory=list,
        description="identity providers outside the fleet whose tokens the coordinator accepts (JSON)",
    )
    otlp_endpoint: str = Field(
        default="",
        # The standard OpenTelemetry variable works too, so a collector set up for other services
        # needs no fleet-specific setting; FLEET_OTLP_ENDPOINT wins when both are set.
        validation_alias=AliasChoices("FLEET_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "otlp_endpoint"),
        description="an OTLP/HTTP base URL (spans go to its /v1/traces); empty: tracing is off",
    )

    allow_plain_http: bool = Field(
        default=False,
        description="send credentials over plain HTTP beyond loopback (only where the network encrypts"
        " every hop itself, e.g. a service mesh with mutual TLS; see fleet.transport)",
    )

    local_stack: bool = Field(
        default=False,
        description="the service runs in the local stack (``fleet up``, one machine): URLs from outside"
        " (cards, webhooks, partner token endpoints) may resolve to loopback and private addresses"
        " (see fleet.outbound)",
    )

    @model_validator(mode="after")
    def _credentials_over_tls(self) -> Self:
        """A URL this service sends tokens or keys to is HTTPS, or on this machine (``fleet.transport``):
        a deployment that gives a plain remote one fails at start, not at its first request."""
        sent = {
            "FLEET_REGISTRY_URL": self.registry_url,
            "FLEET_OPA_URL": self.opa_url if self.opa_token else "",
            "FLEET_LLM_BASE_URL": self.llm_base_url if self.llm_api_key else "",
        }
        for name, url in sent.items():
            if url:
                try:
                    transport.check_url(url, f"credentials ({name})", allow_plain=self.allow_plain_http)
                except FleetError as exc:
                    raise ValueError(exc.message) from None
        return self

    def local_state_dir(self) -> Path:
        """Local durable state of this service (e.g. a specialist's operation journal)."""
        return self.state_dir or self.home / "state" / self.service_id

    @classmethod
    def from_env(cls, service_id: str) -> Self:
        """Settings for ``service_id``; everything else comes from ``FLEET_*`` variables."""
        return cls(service_id=service_id)  # type: ignore[call-arg]  # required fields come from the env
