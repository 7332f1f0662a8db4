"""The overload lab: a demo service, an open-loop load generator, scenarios and verdicts."""
