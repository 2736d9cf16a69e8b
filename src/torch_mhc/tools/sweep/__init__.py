"""`mhc sweep`: short runs of the reference LM over a grid of connection kind x depth x peak
learning rate (x seed), to find where each kind stops training. grid (presets, the checks of
the axes, one TrainConfig per cell), run (the cells through the trainer, resumable, in one
process or several), report (report.md and the heatmaps), command (the `mhc sweep` options)."""
