"""Images as every service sees them: the format, what an image is called, who may run it,
and how an image source is read (the worker's cache and unpacking stay in flyd.images).

- `oci`: the format: media types, digests, descriptors, index/manifest/config JSON
- `reference`: parsing image references (`name:tag`, `name@sha256:...`)
- `owners`: who may run an image, as its manifest records
- `source`: finding an image in a source and reading its blobs, verified
"""
