"""The ASGI application: the app and its middleware (app, middleware), one router per concern (embed, openai,
health), what they share (dependencies, cancellation, embedding), request and response bodies (schemas, answers),
errors mapped once (errors). The HTTP server that runs it is service/server/."""
