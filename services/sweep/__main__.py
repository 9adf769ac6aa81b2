from services.sweep.app import SERVICE
from shared.runtime import main

main(SERVICE)
