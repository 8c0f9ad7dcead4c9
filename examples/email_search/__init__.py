"""Email search (ART•E's task): an agent answers questions from a generated mailbox (README.md)."""
