from services.encode.app import SERVICE
from shared.runtime import main

main(SERVICE)
