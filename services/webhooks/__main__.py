from services.webhooks.app import SERVICE
from shared.runtime import main

main(SERVICE)
