"""The GPU path's parts besides ``DeviceStep`` (``sharding/device_step.py``): the backward, the kernels' feature
table, the error records, the eager backward's graph cache, the comm timeline."""
