"""The HTML report of a run (``velox-batch report``): ``write_report`` and ``build_report``.

``data`` reads what a report shows from the store, ``html`` lays out the page and
its tables, ``charts`` draws the charts (the only module that imports matplotlib,
inside the functions that draw).
"""

from .data import ReportError
from .html import Report, build_report, write_report

__all__ = ["Report", "ReportError", "build_report", "write_report"]
