"""`opd serve-teacher`: load a teacher and serve it over HTTP (`opd.teacher.server`) until interrupted.

    opd serve-teacher --model Qwen/Qwen3-4B --device cuda:1                   # beside the trainer, its own GPU
    opd serve-teacher --model Qwen/Qwen3-8B --device-map auto                 # a teacher too large for one GPU
    opd serve-teacher --model Qwen/Qwen3-4B --host 0.0.0.0 --token-file tok   # for trainers on other hosts

The program: check the address and token (cheap, before any model loads) → bind the port → load the model as a
local teacher is loaded → run uvicorn on the bound socket. `--device-map auto` buys memory (a teacher larger than
one GPU), not speed: the GPUs compute one after another and layers are not compiled (docs/design.md,
"opd.recipes.serve_teacher").
"""

from __future__ import annotations

import logging

from opd.config import ConfigError
from opd.config.serve_teacher import TOKEN_ENV, ServeConfig
from opd.fingerprints import model_fingerprint
from opd.forward import uses_packing
from opd.models import compile_layers, load_model, resolve_device, warm_up_layouts
from opd.rollout.batch import random_rollouts
from opd.scoring import warm_up_row_buckets
from opd.teacher.server import (
    TeacherService,
    bind,
    is_loopback,
    resolve_token,
    run,
    service_for,
)


def check_serve_config(config: ServeConfig) -> str | None:
    """Cheap checks before any model loads; returns the token (None = no auth)."""
    token = resolve_token(config.token_file)
    if token is None and not is_loopback(config.host):
        raise ConfigError(
            f"host={config.host} is not a loopback address: serving it needs a token; pass "
            f"--token-file FILE or set ${TOKEN_ENV} (or bind --host 127.0.0.1)"
        )
    return token


def load_service(config: ServeConfig) -> TeacherService:
    """Load the model as a local teacher is loaded (`opd.models.load_model`, compiled layers on CUDA) and wrap its
    `LocalScorer` in a `TeacherService`."""
    spec = config.model
    model, tokenizer = load_model(
        spec.path,
        dtype=spec.dtype,
        device=spec.device,
        device_map=config.device_map,
        trust_remote_code=spec.trust_remote_code,
        attn_implementation=spec.attn_implementation,
    )
    model.requires_grad_(False)
    device = "device_map" if config.device_map else str(resolve_device(spec.device))
    compiled = compile_layers(model, False if config.device_map else config.compile)
    # every byte of the model's files (hashed as a local teacher's are), so that a server restarted on another
    # checkpoint with the same tokenizer and config answers with another fingerprint
    fingerprint = model_fingerprint(spec.path)
    service = service_for(
        model, tokenizer, config, name=config.name or spec.path, device=device, fingerprint=fingerprint
    )
    if compiled:  # every layout a merged batch can have, compiled before the first request waits for it
        packed = config.forward_tokens if uses_packing(model) else None
        layouts = warm_up_layouts(max(1, min(service.max_positions, config.forward_tokens) - 8), packed)
        for seed, lengths in enumerate(layouts):  # the scorer's own no-grad context, as in requests
            rollouts = random_rollouts(list(range(8)), lengths, vocab_size=service.vocab_size, pad_id=0, seed=seed)
            service.scorer.score(rollouts.to(device), top_k=16)
        warm_up_row_buckets(config.forward_tokens)  # a merged batch may score more positions in one call than these
    return service


def serve(config: ServeConfig) -> None:
    """Run `opd serve-teacher`: check (token, port) → load the model → serve until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    token = check_serve_config(config)
    sock = bind(config.host, config.port)
    try:
        service = load_service(config)
        info = service.info
        run(
            service,
            sock,
            token,
            banner=f"{info['model']} ({info['dtype']}, {info['device']}, vocabulary {info['vocab_size']})",
        )
    finally:
        sock.close()
