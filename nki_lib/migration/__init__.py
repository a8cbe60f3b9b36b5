"""Migration to Trainium: ``dry_run`` reads a user's step before any Trainium is booked."""

from nki_lib.migration.dry_run import dry_run
from nki_lib.migration.report import DryRunReport, OpReport, Specialization

__all__ = ["DryRunReport", "OpReport", "Specialization", "dry_run"]
