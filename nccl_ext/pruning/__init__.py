"""Pruned rings: collectives shared by several sandbox ranks run over rings of live members plus edge virtual ranks."""
