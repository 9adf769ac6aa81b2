from services.api.app import SERVICE
from shared.runtime import main

main(SERVICE)
