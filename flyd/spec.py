"""What a machine's process is: its argv, environment (secrets too), working directory and limits.

Built from the machine's config and its image (OCI rules for entrypoint and cmd; its rootfs,
workdir and user), with the variables flyd gives every machine (MACHINE_ID, APP, ...; the
driver adds PORT) and its published services. The runner hands the result to the driver on
every spawn; the worker checks at create and update that there is an argv.
"""

from __future__ import annotations

from flyd import fsm
from flyd.drivers.base import DEFAULT_PIDS, Limits, PortMapping, ProcessSpec
from flyd.images.cache import Image, ImageCache
from flyd.secrets import SecretBox
from flyd.v1 import machine_pb2 as pb
from model.errors import NotFound
from model.validate import guest_disk_mib

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def argv(config: pb.MachineConfig, image: Image) -> list[str]:
    """The command line: the config's entrypoint and cmd, else the image's."""
    entrypoint = list(config.entrypoint) or list(image.entrypoint)
    if config.cmd:
        cmd = list(config.cmd)
    else:
        # As with OCI runtimes: overriding the entrypoint drops the image's CMD.
        cmd = [] if config.entrypoint else list(image.cmd)
    return entrypoint + cmd


def process_spec(
    row: fsm.Row, images: ImageCache, secret_box: SecretBox | None = None
) -> ProcessSpec:
    """The process to spawn for the machine in `row`, its secrets opened into its environment;
    NotFound if its image left the cache.

    The driver adds `PORT` and `PORT_<internal port>`: the port a service listens on depends
    on whether the machine has a network of its own.
    """
    machine = row.machine
    config = machine.config
    image = images.get(row.image_digest)
    if image is None:
        raise NotFound(f"image {row.image_digest} is no longer cached")
    env = {"PATH": DEFAULT_PATH, **image.env, **config.env}
    if row.secrets:
        if secret_box is None:
            raise ValueError(f"machine {machine.id} has secrets and nothing to open them with")
        env.update(secret_box.open_all(machine.id, row.secrets))
    env.update(
        MACHINE_ID=machine.id,
        APP=machine.app,
        REGION=machine.region,
        WORKER_ID=machine.worker_id,
        INSTANCE_ID=machine.instance_id,
    )
    guest = config.guest
    return ProcessSpec(
        machine_id=machine.id,
        argv=argv(config, image),
        rootfs=image.rootfs,
        env=env,
        limits=Limits(
            cpu_millicores=guest.cpu_millicores,
            memory_mib=guest.memory_mib,
            pids=guest.pids_max or DEFAULT_PIDS,
            disk_mib=guest_disk_mib(guest),
        ),
        workdir=image.workdir,
        user=image.user,
        ports=published(machine),
        host_runtime=image.host_runtime,
        egress=config.network.egress,
    )


def published(machine: pb.Machine) -> tuple[PortMapping, ...]:
    """The machine's published services, as drivers take them."""
    return tuple(PortMapping(p.host_port, p.internal_port) for p in machine.ports)
