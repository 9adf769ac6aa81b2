"""Overload (SPEC 15): refusing at once what cannot be done in time, by priority. `domain` holds the rules (pure),
`edge` the api's ASGI shedder; auth sheds its `auth.check` queue in services/auth/batched.py by the same rules."""
