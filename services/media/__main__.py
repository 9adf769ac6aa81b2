from services.media.app import SERVICE
from shared.runtime import main

main(SERVICE)
