"""Tools: the ``pkvrt`` command and what only it runs.

- :mod:`~pkvrt.tools.cli`: ``pkvrt routes`` and the subcommand table (``python -m pkvrt``).
- :mod:`~pkvrt.tools.plan_cmd`: ``pkvrt plan``, the router's decisions over a trace (no GPU).
- :mod:`~pkvrt.tools.bench`: ``pkvrt bench``, the isolated and serving benches.
- :mod:`~pkvrt.tools.calibrate`, :mod:`~pkvrt.tools.sweeps`: ``pkvrt calibrate``, the sweeps
  that measure a GPU's constants and the fit of the time model;
  :mod:`~pkvrt.tools.calibrate_host`: ``pkvrt calibrate --host-time``, the machine's host time
  per route kind (what the router weighs where routes.toml's ``[host_time]`` is enabled).
- :mod:`~pkvrt.tools.report`: ``pkvrt report``, results files into Markdown tables and plots:
  :mod:`~pkvrt.tools.report_data` reads and computes, :mod:`~pkvrt.tools.report_tables` writes
  the tables (Markdown and CSV appendices), :mod:`~pkvrt.tools.report_plots` draws.
- :mod:`~pkvrt.tools.doctor`: ``pkvrt doctor``, what this machine can run and why not.

May import everything in pkvrt; nothing in pkvrt imports it (but ``pkvrt/__main__.py``).
"""
