"""The HTTP API's wire types (pydantic models and the JSON-ready dicts the hot reads send), one
module per module of ``api.routes``; ``common`` holds the shapes several routes share."""
