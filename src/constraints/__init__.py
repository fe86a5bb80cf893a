"""Structured outputs: grammar compilation and token masks (llguidance).

``grammar`` compiles a request's ``StructuredOutputsParams`` into an
llguidance grammar and validates it (a 400 for one that does not compile);
``masks`` keeps one matcher per constrained request on the worker and fills
and applies their token masks batch by batch.
"""
