"""`mhc cost`: the analytic cost model of a connection kind inside a transformer (model), its
printed tables (format) and the command's options (command)."""
