"""The GPU path's parts besides ``DeviceStep`` (``sharding/device_step.py``): the kernels' feature table, the
error records, the eager backward's graph cache."""
