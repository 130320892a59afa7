"""``vllm-kvplugin verify``: a cache hit proven equal to a recompute on the user's own deployment."""
