"""Collective semantics and the pieces every stage shares: the call, groups, pending ops, the wire, results, threads, errors."""
