"""HTTP routes: parse, call a service, shape the answer. No logic, no SQL."""
