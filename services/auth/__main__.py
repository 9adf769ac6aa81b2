from services.auth.app import SERVICE
from shared.runtime import main

main(SERVICE)
