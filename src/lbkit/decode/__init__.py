"""Decode balancer: place requests on the synchronously stepping ranks of a decode engine."""
