"""Multi-host start-up shared by decoding and training: `jax.distributed.initialize` from flags or the
environment, before any other JAX call (where each setting comes from: docs/modules.md)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Mapping

import jax

from medusa_jax.settings import at_least, check_settings, setting
from medusa_jax.scripts.options import Option, add_fields

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class DistributedError(ValueError):
    """Incomplete or inconsistent multi-process settings."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = None  # host:port of process 0's coordinator service
    num_processes: int | None = setting(None, at_least(1))
    process_id: int | None = setting(None, at_least(0))
    auto: bool = False  # let JAX detect the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU)

    def __post_init__(self):
        check_settings(self, DistributedError)
        explicit = (self.coordinator_address, self.num_processes, self.process_id)
        if not self.auto and any(v is not None for v in explicit) and any(v is None for v in explicit):
            raise DistributedError(
                f"multi-process start needs all of coordinator address, number of processes and process id "
                f"(flags --coordinator/--num-processes/--process-id or env {ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/"
                f"{ENV_PROCESS_ID}); got coordinator={self.coordinator_address!r}, "
                f"num_processes={self.num_processes}, process_id={self.process_id}")
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":")
            if not host.strip() or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
                raise DistributedError(f"--coordinator {self.coordinator_address!r} (or env {ENV_COORDINATOR}): "
                                       f"expected HOST:PORT with a port in 1..65535, e.g. 10.0.0.1:1234")
        n, i = self.num_processes, self.process_id
        if i is not None and n is not None and not 0 <= i < n:
            raise DistributedError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator_address is not None

    @classmethod
    def from_sources(cls, coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, auto: bool = False,
                     environ: Mapping[str, str] | None = None) -> "DistributedConfig":
        """Flags (the arguments) first, then the environment."""
        env = os.environ if environ is None else environ

        def env_int(name: str) -> int | None:
            value = env.get(name)
            if value is None or value == "":
                return None
            if not value.strip().lstrip("-").isdigit():
                raise DistributedError(f"environment variable {name}={value!r} is not an integer")
            return int(value)

        return cls(coordinator if coordinator is not None else (env.get(ENV_COORDINATOR) or None),
                   num_processes if num_processes is not None else env_int(ENV_NUM_PROCESSES),
                   process_id if process_id is not None else env_int(ENV_PROCESS_ID), auto)


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """The multi-host flags (DistributedConfig's fields), on a `cli_args.ArgumentParser` (their rules use its
    check=)."""
    group = parser.add_argument_group("multi-host (one process per host; all flags or env vars, or none)")
    add_fields(group, DistributedConfig(),
               Option("--coordinator", f"address HOST:PORT of process 0's coordinator, reachable from every host "
                      f"(env {ENV_COORDINATOR})", dest="coordinator_address"),
               Option("--num-processes", f"total number of processes, one per host (env {ENV_NUM_PROCESSES})", int),
               Option("--process-id", f"this process's index, 0 .. num-processes - 1 (env {ENV_PROCESS_ID})", int),
               Option("--distributed-auto", "let JAX detect the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) "
                      "instead", dest="auto"))


def config_from_args(args: argparse.Namespace) -> DistributedConfig:
    return DistributedConfig.from_sources(args.coordinator_address, args.num_processes, args.process_id, args.auto)


def initialize(config: DistributedConfig) -> bool:
    """Starts the multi-process runtime when configured; returns whether it did. Call it before any other
    JAX call (it must come before the backends start)."""
    if not config.enabled:
        return False

    # Cross-process collectives of CPU devices (ignored by GPU/TPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=config.coordinator_address,
                                   num_processes=config.num_processes, process_id=config.process_id)
    return True
