"""The contract layer shared by the API (app/) and the workers (workers/).

Request schemas, the job payload and token events, settings, Redis names and the error tree. It
imports neither Flask nor torch, so both sides can depend on it and never on each other.
"""
