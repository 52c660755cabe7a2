"""The tracing branch of the settings tree: OpenTelemetry traces sent over OTLP/HTTP, off unless
configured (docs/deployment.md, "Tracing"); loaded with the rest of the tree (gateway/settings/__init__.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TracingSettings(BaseModel):
    """Where the gateway's spans go, which traces are kept, and what upstreams are told of them."""

    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces (the full URL, path "
        "included). None: no traces are made.")
    service_name: str = Field("routing-gateway", min_length=1, description="The `service.name` the spans carry.")
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="Share of traces kept, decided on the trace id: for new traces, and for "
        "those a client's `traceparent` continues unless `follow_client_sampling`.")
    follow_client_sampling: bool = Field(
        False, description="Keep or drop a trace as the client's `traceparent` says (its sampled flag) instead of "
        "by `sample_ratio`. Only for trusted clients: any client could otherwise have every request traced "
        "(collector cost, a full export queue). Either way the client's trace id is continued.")
    propagate_to_upstreams: bool = Field(
        True, description="Send upstream calls the W3C `traceparent` of their span (the client's trace id, a "
        "client's `tracestate` and `baggage` never), so a self-hosted upstream's spans join the trace. Set false "
        "when upstreams are third parties, which would otherwise see your trace ids.")
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers sent with every export "
                                    "(a collector's API key, for instance).")
    timeout_s: float = Field(10.0, gt=0, description="Seconds one export may take.")

    @property
    def enabled(self) -> bool:
        """True when spans are exported (`otlp_endpoint` is set); else no span is recorded."""
        return self.otlp_endpoint is not None
