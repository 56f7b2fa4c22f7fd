"""What a machine's process is: its argv, environment (secrets too), working directory and limits.

Built from the machine's config and its image (OCI rules for entrypoint and cmd), with the
variables flyd gives every machine (MACHINE_ID, APP, PORT, ...). The runner hands the result
to the driver on every spawn; the worker checks at create and update that there is an argv.
"""

from __future__ import annotations

from flyd import fsm
from flyd.drivers.base import Limits, ProcessSpec
from flyd.errors import NotFound
from flyd.images import confine
from flyd.images.cache import Image, ImageCache
from flyd.secrets import SecretBox
from flyd.v1 import machine_pb2 as pb

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
    NotFound if its image left the cache."""
    machine = row.machine
    config = machine.config
    image = images.get(row.image_digest)
    if image is None:
        raise NotFound(f"image {row.image_digest} is no longer cached")
    args = argv(config, image)
    rootfs = image.rootfs
    # This driver does not chroot: paths of the image are resolved inside its rootfs, and a
    # machine the host would lead elsewhere is refused (UnsafeImage; the spawn fails).
    if args and args[0].startswith("/"):
        program = confine.host_path(rootfs, args[0], "entrypoint")
        if program.exists():
            args[0] = str(program)
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
    for i, port in enumerate(machine.ports):
        if i == 0:
            env["PORT"] = str(port.host_port)
        env[f"PORT_{port.internal_port}"] = str(port.host_port)
    guest = config.guest
    return ProcessSpec(
        machine_id=machine.id,
        argv=args,
        cwd=confine.host_path(rootfs, image.workdir, "WorkingDir"),
        env=env,
        limits=Limits(cpu_millicores=guest.cpu_millicores, memory_mib=guest.memory_mib),
    )
