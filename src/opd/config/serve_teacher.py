"""`opd serve-teacher`'s config (plain data; the program is `opd.recipes.serve_teacher.serve`): the limits of what a
teacher server accepts (`ServeLimits`, which `opd.teacher.server.TeacherService` reads) and, on top of them, the model
and the address."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from opd.config.sections import ModelSpec, Section

TOKEN_ENV = "OPD_TEACHER_TOKEN"
MIN_TOKEN_LENGTH = 16
# batch_window_ms delays every request (the oldest waiting one waits this long for others); a scoring forward of
# max_batch_tokens takes well under a second on a GPU, so a longer wait costs more than any merge saves.
MAX_BATCH_WINDOW_MS = 1000.0
# request_timeout_s is how long any peer, authenticated or not, holds a connection (and, sending a body, its bytes of
# max_inflight_bytes); ten minutes send the largest default body (64 MiB) over a 1 Mbit/s link, longer only lets a
# stalled peer hold them.
MAX_REQUEST_TIMEOUT_S = 600.0


def _batch_window(value: float) -> float:
    if value > MAX_BATCH_WINDOW_MS:
        raise ValueError(
            f"{value:g} is above {MAX_BATCH_WINDOW_MS:g} ms: the window delays every request this long, longer than a "
            f"scoring forward takes, so waiting costs more than merging saves; use 0 to {MAX_BATCH_WINDOW_MS:g}"
        )
    return value


def _request_timeout(value: float) -> float:
    if value > MAX_REQUEST_TIMEOUT_S:
        raise ValueError(
            f"{value:g} is above {MAX_REQUEST_TIMEOUT_S:g} s: any peer, authenticated or not, holds a connection (and "
            f"its body's bytes) this long, and {MAX_REQUEST_TIMEOUT_S:g} s send a 64 MiB body at 1 Mbit/s; use a value "
            f"in (0, {MAX_REQUEST_TIMEOUT_S:g}]"
        )
    return value


class ServeLimits(Section):
    """What a teacher server accepts and how it batches (the limits of `TeacherService`); `opd serve-teacher`'s
    config extends it with the model and the address."""

    forward_tokens: int = Field(32768, ge=1, description="Input tokens per scoring forward (LocalScorer's budget).")
    max_batch_tokens: int = Field(32768, ge=1, description="Tokens of merged requests per scoring batch.")
    batch_window_ms: Annotated[float, AfterValidator(_batch_window)] = Field(
        2.0,
        ge=0.0,
        description="How long the oldest waiting request waits for others to merge with, in milliseconds (at most "
        f"{MAX_BATCH_WINDOW_MS:g}); 0 = merge only what is already queued.",
    )
    max_queue_tokens: int = Field(1 << 20, ge=1, description="Tokens waiting beyond which requests get 503.")
    max_request_bytes: int = Field(64 << 20, ge=1024, description="Largest request body in bytes (413 above).")
    max_rows: int = Field(4096, ge=1, description="Rows per request.")
    max_positions: int | None = Field(
        None, ge=1, description="Tokens per row (prompt and response); None: the model's context length."
    )
    max_requested_ids: int = Field(256, ge=0, description="Requested ids per position.")
    max_top_k: int = Field(256, ge=0, description="Largest top-k a request may ask for.")
    max_inflight_bytes: int = Field(
        256 << 20,
        ge=1024,
        description="Request bytes held at once over all connections (503 + Retry-After above); ≥ max_request_bytes.",
    )
    max_connections: int = Field(
        256,
        ge=2,
        description="Open connections; beyond it the oldest one idle or still sending its request headers is "
        "closed (so half-open clients cannot lock others out).",
    )
    request_timeout_s: Annotated[float, AfterValidator(_request_timeout)] = Field(
        30.0,
        gt=0,
        description="Seconds a client has to send a request's headers, and again its body (408 after); at most "
        f"{MAX_REQUEST_TIMEOUT_S:g}.",
    )

    @model_validator(mode="after")
    def _inflight_fits_a_request(self) -> ServeLimits:
        if self.max_inflight_bytes < self.max_request_bytes:
            raise ValueError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) must be ≥ max_request_bytes "
                f"({self.max_request_bytes}): a largest request could never be admitted"
            )
        return self


class ServeConfig(ServeLimits):
    """`opd serve-teacher`: which teacher to serve, where, and (the fields of `ServeLimits`) the limits of what it
    accepts."""

    model: ModelSpec
    device_map: Literal["auto"] | None = Field(
        None,
        description="auto: split the model over all visible GPUs (accelerate; its cost: the docstring of "
        "opd.recipes.serve_teacher); None: the whole model on model.device.",
    )
    name: str | None = Field(None, description="Model name /info reports; None: model.path.")
    host: str = Field("127.0.0.1", description="Address to bind; anything but a loopback address needs a token.")
    port: int = Field(8765, ge=0, le=65535, description="TCP port; 0 = any free port (printed at start).")
    token_file: str | None = Field(
        None,
        description=f"File holding the bearer token (≥ {MIN_TOKEN_LENGTH} "
        f"characters); None: the {TOKEN_ENV} environment variable, if set.",
    )
    compile: bool | None = Field(
        None,
        description="torch.compile the decoder layers (as `opd distill` does); None: on CUDA without a device map.",
    )

    @model_validator(mode="after")
    def _one_placement(self) -> ServeConfig:
        if self.device_map is not None and self.model.device != "auto":
            raise ValueError(f"give model.device ({self.model.device}) or device_map ({self.device_map}), not both")
        return self
