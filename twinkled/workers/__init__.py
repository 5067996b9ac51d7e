"""The worker group: processes that own the devices and run the engine (see DESIGN.md).

`supervisor` (daemon side, torch-free) starts and drives them; `worker` is a rank's main
loop; `runner` runs one step frame on a rank; `frames` is what travels between them.
"""
