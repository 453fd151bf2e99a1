"""``tokenmill dashboard``: a run's live page in a browser.

:mod:`producer.dashboard.server` serves a static page (``static/``: HTML, CSS, JavaScript and
the vendored charting library uPlot, so the page works without network access) and a JSON API
that answers from :class:`tokenmill.Client`, the code ``tokenmill status`` and ``runs`` run:
``api/runs``, ``api/status``, ``api/history`` (the time series of :mod:`tokenmill.history`) and
``api/samples`` (recent completions, :mod:`producer.samples`). :mod:`producer.dashboard.cli` is
the command.
"""
