"""`mhc cost`: the analytic cost model of a connection kind inside a transformer (model) and
its printed tables."""
