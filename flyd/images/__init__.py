"""OCI images for flyd: what a worker runs its machines from.

An image lives in an image source as an OCI image layout or a tar of one; a worker pulls it
into its content-addressed cache, verified blob by blob and unpacked into a rootfs its machines
share. The modules, from the bottom up:

- `oci`: the format: media types, digests, descriptors, index/manifest/config JSON
- `reference`: parsing image references (`name:tag`, `name@sha256:...`)
- `build`: a directory tree becomes a one-layer image in a source's layout
- `source`: finding an image in a source and reading its blobs, verified
- `unpack`: applying layers to a rootfs, refusing anything unsafe
- `cache`: the worker's image cache (pull, references, eviction)
"""
