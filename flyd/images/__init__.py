"""OCI images for flyd: what a worker runs its machines from.

An image lives in an image source as an OCI image layout or a tar of one; a worker pulls it
into its content-addressed cache, verified blob by blob and unpacked into a rootfs its machines
share. The format, the references, who may run an image and reading a source are the machine
model's (model.images: flaps and the CLI read them too); the worker's part, here:

- `base`: what `nonomad image build --base` stacks a directory's layer on
- `build`: a directory tree becomes a one-layer image in a source's layout
- `unpack`: applying layers to a rootfs, refusing anything unsafe
- `confine`: the paths an image's config names, resolved inside its rootfs
- `cache`: the worker's image cache (pull, references, eviction)
"""
