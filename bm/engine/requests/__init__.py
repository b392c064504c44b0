"""Requests and their checks: the typed core request and response, the table of request fields, the one
validation into the scheduler's request, and what a request carries (model inputs, samples and their seeds,
stop rules, structured output, draft tokens). The bottom of the engine: it imports no other part of it."""
