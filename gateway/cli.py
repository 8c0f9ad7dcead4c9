"""Run the OpenAI-compatible gateway in front of vLLM servers; it logs every completion to Kafka."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.config_flags import add_config_flags, given
from streamrl.usage import UsageError, as_usage_error, check_bootstrap_servers, check_port_free, check_url

from .auth import check_bind, load_keys
from .config import GatewayConfig

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

DESCRIPTION = """\
The OpenAI-compatible gateway: put it in front of vLLM servers and point any OpenAI client at it. Every
completion is passed through unchanged and recorded token-exact to Kafka; rewards are posted to it over
HTTP; each policy version the trainer publishes is loaded into every upstream and routed to with no
request blocked.

  streamrl gateway --upstream http://127.0.0.1:8000 --bootstrap-servers 127.0.0.1:9092 --port 8080
  streamrl gateway --config gateway.toml --api-keys keys.txt --host 0.0.0.0

Options that matter most: --upstream (repeat for several vLLM servers), --bootstrap-servers, --port,
--api-keys (required on an address other hosts reach). Docs: docs/gateway.md."""

KEEP_ALIVE_S = 75
"""Idle keep-alive connections stay open this long (uvicorn's 5 s default makes agents that pause
between calls race the server's close more often)."""


FLAG_NAMES = {"upstreams": "upstream", "upstream_timeout_s": "upstream-timeout"}
"""Fields whose flag is not simply the field's name (``--field-name``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or JSON file of GatewayConfig fields, every one of them "
                                    "(a [gateway] table if present); the flags below override it")
    p.add_argument("--no-logging", action="store_true",
                   help="forward only, log nothing (for measuring the gateway's overhead)")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind the port with SO_REUSEPORT, beside other gateway processes on it (what each of "
                        "--workers N does)")
    add_config_flags(p, GatewayConfig, names=FLAG_NAMES)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """``GatewayConfig.load``: defaults < ``--config`` < the flags given."""
    values = given(args, GatewayConfig)
    if args.config is None and "upstreams" not in values:
        raise UsageError("give --upstream URL (a vLLM server; repeat for several), or --config FILE")
    config = GatewayConfig.load(args.config, **values)
    if args.no_logging:
        return dataclasses.replace(config, kafka=dataclasses.replace(config.kafka, bootstrap_servers=None))
    if config.kafka.bootstrap_servers is None:
        raise UsageError("give --bootstrap-servers (or [gateway.kafka] bootstrap_servers in --config), "
                         "or --no-logging to forward without logging")
    return config


def preflight(config: GatewayConfig, reuse_port: bool) -> None:
    """The upstreams' URLs, the broker's address, the API keys (and none missing on an address other hosts
    reach), then the port, free unless it is shared on purpose (``--reuse-port``, ``--workers``: the
    processes bind it beside each other)."""
    for url in config.upstreams:
        check_url(url, "--upstream")
    if config.kafka.bootstrap_servers is not None:
        check_bootstrap_servers(config.kafka.bootstrap_servers, "--bootstrap-servers")
        with as_usage_error():  # its TLS files exist, its SASL password is somewhere
            config.kafka.client_kwargs()
    with as_usage_error():
        check_bind(config.host, load_keys(config.api_keys, os.environ), config.insecure)
    if not reuse_port:
        check_port_free(config.host, config.port, "--port")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .workers import Workers, reuseport_socket

    config = config_from_args(args)
    preflight(config, args.reuse_port)
    if config.workers > 1:
        with as_usage_error():
            # the workers' config files beside the given one (``streamrl up``: in its run directory)
            workers = Workers(config, Path(args.config).parent / "gateway-workers" if args.config else None)
        return workers.run()
    with as_usage_error():  # a bad key file, or keys missing on a public address (gateway/auth.py)
        app = create_app(config)
    server = uvicorn.Server(uvicorn_config(app, config))
    # uvicorn raises the signal that stopped it again once it has shut down; under the default handlers that
    # ends the process before its exit handlers run (the record producer's semaphores then leak, reported by
    # multiprocessing's resource tracker, and Ctrl-C ends in a traceback). By then the signal has done its job.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    if args.reuse_port:
        server.run(sockets=[reuseport_socket(config.host, config.port)])
    else:
        server.run()
    return 0


def uvicorn_config(app: FastAPI, config: GatewayConfig) -> uvicorn.Config:
    """How every gateway process serves (``streamrl gateway``, its workers, ``GatewayServer``)."""
    import uvicorn

    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                          loop="uvloop", http="httptools", timeout_keep_alive=KEEP_ALIVE_S,
                          timeout_graceful_shutdown=config.shutdown_grace_s)
